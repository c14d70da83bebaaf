"""One unit of a grid, in its own process: ``python -m mosaic.experiment.job JOB.json``.

Trains the run (``mosaic train``'s loop; resumes a killed run) unless it is done,
then evaluates the final model — or the warm start — on each evaluation it is
given, writing ``evals/<name>.jsonl`` (per-question outcomes) and
``evals/<name>.json`` (accuracy, interval, session metrics, seconds).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from statistics import median

import torch

from mosaic.experiment.runner import DONE
from mosaic.experiment.spec import EvalSpec
from mosaic.train import setup
from mosaic.train.checkpoint import find_latest
from mosaic.config.loader import Config, loads_config
from mosaic.train.entrypoints import ensure_warm_start, run_train
from mosaic.train.evaluate import evaluate
from mosaic.train.runlog import read_metrics



def _train(cfg: Config, d: Path) -> None:
    t0 = time.perf_counter()
    run_train(cfg)
    steps = [m["timing_s/step"] for m in read_metrics(d) if "timing_s/step" in m]
    (d / DONE).write_text(json.dumps({
        "seconds": time.perf_counter() - t0, "steps": len(steps), "step_s": median(steps) if steps else 0.0,
        "rollouts_per_step": cfg.train.batch_tasks * cfg.train.group_size,
    }, indent=1))


STALE = ("done.json", "metrics.jsonl", "summary.md", "reused.json", "samples.jsonl", "evals", "plots", "tb")


def _clear_lost_run(d: Path) -> None:
    """A finished run whose checkpoints are gone is trained again: its old metrics and evaluations
    describe weights that no longer exist, so they go before the new run writes its own."""
    for name in STALE:
        p = d / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    print(f"[mosaic] {d.name}: checkpoints missing; old results cleared, training again", flush=True)


def _evaluate(ecfg: Config, model_dir: Path, e: EvalSpec, out: Path, ecfg_yaml: str) -> None:
    cfg = dataclasses.replace(ecfg, data=dataclasses.replace(ecfg.data, seed=e.data_seed, n_eval_tasks=e.n_tasks))
    device = setup.resolve_device(cfg)
    model, tok = setup.load_policy(model_dir, device=device, dtype=setup.resolve_dtype(cfg, device))
    chat = setup.chat_format(tok)
    split = setup.load_split(cfg, e.split)
    t0 = time.perf_counter()
    r = evaluate(cfg, model, tok, chat, split, n_tasks=e.n_tasks, samples=e.samples, temperature=e.temperature,
                 seed=e.seed, out=out / f"{e.name}.jsonl", progress=False)  # fmt: skip
    meta = {"key": e.key(), "eval": e.__dict__, "model": str(model_dir), "accuracy": r.accuracy, "lo": r.lo,
            "hi": r.hi, "n_questions": r.n_questions, "trajectories": e.n_tasks * e.samples,
            "seconds": time.perf_counter() - t0, "metrics": r.metrics,
            "eval_config": ecfg_yaml}  # fmt: skip  (the grid's evaluation config: harness, sampling)
    (out / f"{e.name}.json").write_text(json.dumps(meta, indent=1))
    print(f"[mosaic] {e.name}: {r.line(e.name)}", flush=True)


def main(path: str) -> int:
    job = json.loads(Path(path).read_text())
    threads = int(os.environ.get("MOSAIC_THREADS", "0") or 0)
    if threads:
        torch.set_num_threads(threads)
    d = Path(job["dir"])
    cfg = loads_config(job["config_yaml"])
    ecfg = loads_config(job["eval_config_yaml"])
    if job.get("retrain"):
        _clear_lost_run(d)
    if job["train"]:
        _train(cfg, d)
    if job["warm_start"]:
        model_dir = ensure_warm_start(ecfg)
    else:
        ck = find_latest(d)
        if ck is None:
            raise FileNotFoundError(f"{d}: no checkpoint to evaluate")
        model_dir = ck / "model"
    (d / "evals").mkdir(parents=True, exist_ok=True)
    for e in job["evals"]:
        e = {k: v for k, v in e.items() if k != "key"}
        _evaluate(ecfg, model_dir, EvalSpec(**e), d / "evals", job["eval_config_yaml"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
