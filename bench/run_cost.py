"""What one grid run costs now against an older commit: training, then the grid's held-out evaluations.

One run of ``experiments/compaction.yaml`` (an arm and seed of it: the grid's own resolved config, as
``mosaic experiment`` would train it), then its evaluations (each grid eval on the final checkpoint, as
``mosaic.experiment.job`` runs them), once with this tree's code and once with ``--old`` (checked out
with ``git worktree add`` into a temp dir), each in its own process, interleaved (old, new; new, old; ...)
so both see the same machine load; same config and seed. Prints seconds per phase, summed over the run
(wall, or with ``--clock cpu`` the process's CPU time: on a shared machine, with ``--threads 1``), and old / new:

- generation: the rollouts (gain probes run live during them included); gain scoring: the pass after them;
- reference pass: the KL anchor's forwards (timed by hooks on the reference model's decoder and head);
- update: ``timing_s/update_actor`` less the reference pass;
- evaluation: the evaluations' wall time, gain scoring included (and trajectories per second); of it,
  the gain scoring run after the rollouts (``eval: scoring after``; now most states are scored live);

then both runs' held-out accuracies with their 95 % intervals.

    python bench/run_cost.py                                   # the full run: 20 steps, 3 x 128 x 2 (~30 min)
    python bench/run_cost.py --steps 3 --questions 16 --threads 1 --clock cpu   # a quick check, shared machine
    python bench/run_cost.py --old e59818e --arm mosaic --seed 0 --rounds 2 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASES = ("generation", "gain scoring", "reference pass", "update", "evaluation", "eval: scoring after")
# (training's seconds outside the phases: setup, checkpoints; in "training (all)")


# ----------------------------------------------------------------------------- one run (in the tree's process)
class Clocks:
    """Seconds per phase on both clocks: wall (``perf_counter``) and this process's CPU (``process_time``)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def add(self, phase: str, wall: float, cpu: float) -> None:
        self.wall[phase] = self.wall.get(phase, 0.0) + wall
        self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu

    def wrap(self, owner, name: str, phase: str) -> None:
        """Time every call of ``owner.name`` (looked up by name at call time, as the callers do)."""
        fn = getattr(owner, name)

        def timed(*a, **k):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                self.add(phase, time.perf_counter() - w, time.process_time() - c)

        setattr(owner, name, timed)

    def hook(self, module, phase: str) -> None:
        """Time ``module``'s forward calls."""
        t0: dict = {}
        module.register_forward_pre_hook(lambda m, a: t0.update(w=time.perf_counter(), c=time.process_time()))
        module.register_forward_hook(lambda m, a, o: self.add(phase, time.perf_counter() - t0["w"],
                                                               time.process_time() - t0["c"]))


def unit(args) -> None:
    """Train the grid's run and evaluate it with the code of the tree this process imports ``mosaic`` from."""
    import dataclasses

    import torch

    from mosaic.experiment.spec import load_grid
    from mosaic.train import entrypoints, evaluate as ev, rl, setup
    from mosaic.train.checkpoint import find_latest

    try:  # the config module moved (issue 26); the older commit has it under train/
        from mosaic.config.loader import load_config
    except ImportError:
        from mosaic.train.config import load_config

    torch.set_num_threads(args.threads)
    grid = load_grid(Path(args.grid))
    run = next((r for r in grid.runs if r.arm == args.arm and r.seed == args.seed), None)
    if run is None:
        sys.exit(f"run_cost: no run of arm {args.arm!r} with seed {args.seed} in {args.grid}")
    cfg = run.config
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=args.work, steps=args.steps or cfg.train.steps),
                              data=dataclasses.replace(cfg.data, cache_dir=args.cache))  # fmt: skip
    clocks = Clocks()
    try:  # the rollouts (live gain probes run inside them): the rollout source's, or older code's helper
        from mosaic.train.sources import HarnessRollouts

        clocks.wrap(HarnessRollouts, "collect", "generation")
    except ImportError:
        clocks.wrap(rl, "_rollout", "generation")
    clocks.wrap(rl, "score_for", "gain scoring")
    clocks.wrap(rl, "update", "update")
    clocks.wrap(ev, "evaluate", "evaluation")
    clocks.wrap(ev, "score_gains_", "eval: scoring after")
    make_ref = entrypoints.make_reference

    def timed_reference(model):
        ref = make_ref(model)
        # the update calls the decoder and the output layer directly (not ``ref.forward``)
        clocks.hook(ref.get_decoder(), "reference pass")
        clocks.hook(ref.get_output_embeddings(), "reference pass")
        return ref

    entrypoints.make_reference = timed_reference
    w, c = time.perf_counter(), time.process_time()
    entrypoints.run_train(cfg)
    out = {"train_s": time.perf_counter() - w, "train_cpu_s": time.process_time() - c, "evals": []}
    model_dir = find_latest(Path(args.work)) / "model"
    for e in grid.evals:
        n = args.questions or e.n_tasks
        ecfg = load_config(grid.preset, overrides=[*grid.eval_overrides(run.setting), f"data.seed={e.data_seed}",
                                                   f"data.n_eval_tasks={n}", f"data.cache_dir={args.cache}"])
        model, tok = setup.load_policy(model_dir, device=torch.device("cpu"), dtype=torch.float32)
        split = setup.load_split(ecfg, e.split)
        t, c = time.perf_counter(), time.process_time()
        r = ev.evaluate(ecfg, model, tok, setup.chat_format(tok), split, n_tasks=n, samples=e.samples,
                        temperature=e.temperature, seed=e.seed, progress=False)
        out["evals"].append({"name": e.name, "accuracy": r.accuracy, "lo": r.lo, "hi": r.hi, "trajectories": n * e.samples,
                             "seconds": time.perf_counter() - t, "cpu_s": time.process_time() - c})  # fmt: skip
    for clock, d in (("wall", clocks.wall), ("cpu", clocks.cpu)):
        d["update"] = d.get("update", 0.0) - d.get("reference pass", 0.0)  # the reference pass runs inside it
        out[clock] = d
    Path(args.out).write_text(json.dumps(out))


# ----------------------------------------------------------------------------- the comparison
def _checkout(commit: str, where: Path) -> Path:
    tree = where / f"old-{commit}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return tree


def _run(tree: Path, label: str, args, tmp: Path, k: int) -> dict:
    out, work = tmp / f"{label}-{k}.json", tmp / f"{label}-{k}-run"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--unit", "--grid", str(tree / args.grid), "--arm", args.arm,
           "--seed", str(args.seed), "--steps", str(args.steps), "--questions", str(args.questions), "--threads",
           str(args.threads), "--work", str(work), "--out", str(out), "--cache", str(args.cache)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    t = time.perf_counter()
    with open(tmp / f"{label}-{k}.log", "w") as log:
        rc = subprocess.call(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:  # (the temp dir and its log go when we exit: show the log's end)
        tail = (tmp / f"{label}-{k}.log").read_text().splitlines()[-25:]
        sys.exit("\n".join([*tail, f"run_cost: the {label} run failed (exit {rc}) in {tree}"]))
    res = json.loads(out.read_text())
    res["wall_s"] = time.perf_counter() - t
    print(f"  {label} run {k + 1}: {res['wall_s']:.0f} s wall", flush=True)
    return res


def _report(runs: dict[str, list[dict]], old: str, clock: str) -> None:
    def med(side, f):
        return statistics.median(f(r) for r in runs[side])

    what = "CPU seconds of the run's process" if clock == "cpu" else "wall seconds"
    print(f"\n{what} per run (median of {len(runs['new'])}), old = {old}:")
    print(f"  {'phase':<22}{'old':>10}{'new':>10}{'old/new':>10}")
    rows = [(p, lambda r, p=p: r[clock].get(p, 0.0)) for p in PHASES]
    rows += [("training (all)", lambda r: r["train_cpu_s" if clock == "cpu" else "train_s"]),
             ("run (train + evals)", lambda r: r["train_cpu_s" if clock == "cpu" else "train_s"] + r[clock]["evaluation"]),
             ("process wall", lambda r: r["wall_s"])]
    for name, f in rows:
        a, b = med("old", f), med("new", f)
        print(f"  {name:<22}{a:10.1f}{b:10.1f}{a / b if b > 0 else float('nan'):10.2f}")
    key = "cpu_s" if clock == "cpu" else "seconds"
    tps = {s: med(s, lambda r: sum(e["trajectories"] for e in r["evals"]) / max(1e-9, sum(e[key] for e in r["evals"])))
           for s in runs}
    print(f"  evaluation trajectories per {clock} second: old {tps['old']:.2f}, new {tps['new']:.2f} "
          f"({tps['new'] / tps['old']:.2f}x)")
    print("\nheld-out accuracy (%, 95 % interval), first run of each side:")
    for a, b in zip(runs["old"][0]["evals"], runs["new"][0]["evals"]):
        print(f"  {a['name']:<10} old {100 * a['accuracy']:5.1f} [{100 * a['lo']:.1f}, {100 * a['hi']:.1f}]   "
              f"new {100 * b['accuracy']:5.1f} [{100 * b['lo']:.1f}, {100 * b['hi']:.1f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", default="e59818e", help="the commit to compare with (default: main before issue 27)")
    ap.add_argument("--grid", default="experiments/compaction.yaml", help="grid file, relative to each tree")
    ap.add_argument("--arm", default="mosaic")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0, help="training steps (0: the grid's)")
    ap.add_argument("--questions", type=int, default=0, help="questions per evaluation (0: the grid's)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per side, interleaved")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="what the table compares: wall seconds (a quiet machine) or the process's CPU seconds "
                         "(a shared one; use with --threads 1)")
    ap.add_argument("--cache", default=str(REPO / ".mosaic-cache"), help="data cache both sides share")
    ap.add_argument("--unit", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.unit:
        return unit(args)
    if args.steps < 0 or args.questions < 0 or args.rounds < 1 or args.threads < 1:
        ap.error("--steps/--questions must be >= 0, --rounds/--threads >= 1")
    with tempfile.TemporaryDirectory(prefix="run-cost-") as d:
        tmp = Path(d)
        old = _checkout(args.old, tmp)
        try:
            runs: dict[str, list[dict]] = {"old": [], "new": []}
            for k in range(args.rounds):
                for label in (("old", "new") if k % 2 == 0 else ("new", "old")):
                    runs[label].append(_run(old if label == "old" else REPO, label, args, tmp, k))
            _report(runs, args.old, args.clock)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)


if __name__ == "__main__":
    main()
