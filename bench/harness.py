"""Step-time overhead of training through an external harness (``rollout.source=harness``).

The same RL job run twice in this process, interleaved step by step on fresh copies of the same
warm start: once with the built-in harness, once with ``examples/harness/plain.py`` (the ~50-line
``openai``-client harness, same prompts and budgets) behind the in-process server and the recording
proxy. Same model (the shipped ``cpu`` base model), tasks, group size, seed and estimator; each side
keeps its own optimizer, so both run the same number of updates.

Printed per side: median seconds per step and per sampled (trainable) token, with the split into
rollout (``timing_s/gen``), scoring and update; the served policy's decode batches per step and their mean size;
then the ratio harness / built-in (target <= 1.1x): medians of the steps, and the ratio of the totals with a
95 % interval from a paired bootstrap over the steps (steps differ by 20-40 % in sampled tokens and the
machine's load moves: one run's point figure alone does not settle a 10 % question). Last, where the
platform has ``/proc`` (Linux), where the harness side's generation time goes, per sampled token: its wall
time against the built-in's, and the CPU time of the model worker, of the server's and proxy's event loops
and of the harness's threads (each thread's CPU read every 20 ms; a thread that ends loses at most its last
20 ms). When the worker's CPU is about the built-in's generation and the wall time is about the sum of the
three, the serving threads' Python is what the served path adds, run one after the other with the model's.
The two harnesses are different agent loops (the plain one re-renders its history through the chat
template on every call, and its sub-agent and compaction rules are its own), so they sample
different numbers of tokens: the per-token ratio is the fair one, the per-step one is what a user
waits.

Usage: python bench/harness.py [--steps 3] [--batch-tasks 2] [--group-size 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-tasks", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--estimator", default="mosaic")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from mosaic.train import setup
    from mosaic.config.loader import load_config
    from mosaic.train.entrypoints import ensure_warm_start
    from mosaic.train.external import ExternalRollouts
    from mosaic.train.optim import build_optimizer, build_scheduler
    from mosaic.train.rl import RLState, rl_step

    work = Path(tempfile.mkdtemp(prefix="bench-harness-"))
    common = [f"train.batch_tasks={args.batch_tasks}", f"train.group_size={args.group_size}",
              f"algo.estimator={args.estimator}", "train.heldout_split=none", "train.rollout_samples=0",
              f"train.run_dir={work}"]
    sides = {
        "built-in": load_config("cpu", overrides=common),
        "harness": load_config("cpu", overrides=common + [
            "rollout.source=harness", f"rollout.harness={ROOT / 'examples/harness/plain.py'}:run"]),
    }
    dev = torch.device("cpu")
    states = {}
    for name, cfg in sides.items():
        model, tok = setup.load_policy(ensure_warm_start(cfg), device=dev, dtype=torch.float32)
        split = setup.load_split(cfg, "train")
        opt = build_optimizer(model, cfg.optim)
        source = ExternalRollouts(cfg, model, tok, split, work / "records") if cfg.rollout.source == "harness" else None
        states[name] = RLState(cfg, model, tok, setup.chat_format(tok), split, opt,
                               build_scheduler(opt, cfg.optim, args.steps), dev, source=source)
    rows: dict[str, list[dict]] = {n: [] for n in states}
    kinds: dict[str, Counter] = {n: Counter() for n in states}
    cpu = ThreadCPU()
    try:
        for step in range(args.steps):
            for name, st in states.items():  # interleaved: both sides see the same machine load
                before = cpu.read()
                m = rl_step(st, step)
                m.update({f"cpu/{k}": v for k, v in (cpu.read() - before).items()})
                m["tokens"] = sum(sum(s.loss_mask) for t in st.last_trajs for s in t.sessions)
                for t in st.last_trajs:
                    kinds[name].update(t.count_kinds())
                    kinds[name]["trajectories"] += 1
                rows[name].append(m)
                print(f"step {step} {name:9s} {m['timing_s/step']:7.2f} s  {m['tokens']:6d} sampled tokens  "
                      f"kept {m.get('rollout/kept', len(st.last_trajs)):.0f}", flush=True)
    finally:
        for st in states.values():
            if st.source is not None:
                st.source.close()

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    print(f"\n{'':10s} {'s/step':>8s} {'ms/token':>9s} {'gen':>7s} {'score':>7s} {'update':>7s} {'sessions':>9s}")
    per_tok = {}
    for name in rows:
        per_tok[name] = statistics.median(1000 * r["timing_s/step"] / max(1, r["tokens"]) for r in rows[name])
        print(f"{name:10s} {med(name, 'timing_s/step'):8.2f} {per_tok[name]:9.2f} {med(name, 'timing_s/gen'):7.2f} "
              f"{med(name, 'timing_s/score'):7.2f} {med(name, 'timing_s/update_actor'):7.2f} "
              f"{med(name, 'session/per_traj'):9.2f}")
    for name in rows:  # the two agent loops need not open the same sessions: per kind, per trajectory
        n = max(1, kinds[name].pop("trajectories", 0))
        print(f"{name:10s} sessions per trajectory by kind: "
              + ", ".join(f"{k} {c / n:.2f}" for k, c in sorted(kinds[name].items())))
    total = {n: sum(r["timing_s/step"] for r in rows[n]) / max(1, sum(r["tokens"] for r in rows[n])) for n in rows}
    print(f"all steps together: {1000 * total['built-in']:.2f} vs {1000 * total['harness']:.2f} ms per sampled token")
    if all("rollout/served_batch_mean" in r for r in rows["harness"]):
        print(f"harness side: the served policy decoded {med('harness', 'rollout/served_batches'):.0f} batches per step, "
              f"{med('harness', 'rollout/served_batch_mean'):.2f} sequences each (median over steps); the built-in "
              f"harness decodes each round's turns of all {len(states['built-in'].last_trajs)} rollouts together")
    print(f"\nharness / built-in: {med('harness', 'timing_s/step') / med('built-in', 'timing_s/step'):.2f}x per step, "
          f"{per_tok['harness'] / per_tok['built-in']:.2f}x per sampled token (median of the steps; all steps together "
          f"{total['harness'] / total['built-in']:.2f}x) (target <= 1.1x)")
    step_ci, tok_ci = paired_ratio_intervals(rows["built-in"], rows["harness"])
    print(f"all steps together with 95 % intervals (paired bootstrap over the {args.steps} interleaved steps): "
          f"{step_ci[0]:.2f}x [{step_ci[1]:.2f}, {step_ci[2]:.2f}] per step, {tok_ci[0]:.2f}x [{tok_ci[1]:.2f}, "
          f"{tok_ci[2]:.2f}] per sampled token")
    if cpu.ok:
        print_generation_split(rows)


def print_generation_split(rows: dict[str, list[dict]]) -> None:
    """The harness side's generation per sampled token: wall time, and CPU time by thread group."""
    def per_token(name: str, key: str) -> float:
        return 1e6 * sum(r.get(key, 0.0) for r in rows[name]) / max(1, sum(r["tokens"] for r in rows[name]))

    parts = ", ".join(f"{label} {per_token('harness', 'cpu/' + label):.0f}" for _, label in ThreadCPU.GROUPS)
    print(f"generation per sampled token (us, all steps): built-in {per_token('built-in', 'timing_s/gen'):.0f} "
          f"wall; harness {per_token('harness', 'timing_s/gen'):.0f} wall, CPU by thread: {parts}")


class ThreadCPU:
    """CPU seconds of this process's threads by group (:attr:`GROUPS`, by thread name), read from ``/proc``
    every 20 ms; ``ok`` is False where there is no ``/proc/self/task`` (then every figure stays 0)."""

    GROUPS = (("mosaic-model-worker", "model worker"), ("mosaic-uvicorn", "server and proxy loops"),
              ("harness-", "harness threads"))

    def __init__(self, every_s: float = 0.02) -> None:
        self.ok = os.path.isdir("/proc/self/task")
        self.tick = os.sysconf("SC_CLK_TCK") if self.ok else 100
        self.total: Counter = Counter()
        self.last: dict[str, int] = {}
        self.lock = threading.Lock()
        if self.ok:
            threading.Thread(target=self._run, args=(every_s,), name="bench-cpu", daemon=True).start()

    def read(self) -> Counter:
        with self.lock:
            self._poll()
            return Counter(self.total)

    def _run(self, every_s: float) -> None:
        while True:
            with self.lock:
                self._poll()
            time.sleep(every_s)

    def _poll(self) -> None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended
                continue
            ticks = int(fields[11]) + int(fields[12])  # utime + stime
            delta = ticks - self.last.get(tid, ticks)
            self.last[tid] = ticks
            name = names.get(int(tid), "")
            label = next((lab for prefix, lab in self.GROUPS if name.startswith(prefix)), None)
            if label is not None and delta > 0:
                self.total[label] += delta / self.tick


def paired_ratio_intervals(base: list[dict], other: list[dict], draws: int = 4000, seed: int = 0):
    """``(ratio, lo, hi)`` per step and per sampled token of ``other`` over ``base``: the ratio of their totals
    over the steps, and a 95 % percentile interval from resampling the steps (a step's two sides together:
    they ran back to back under the same machine load)."""
    import random

    rng = random.Random(seed)
    n = len(base)

    def ratios(idx):
        sb = sum(base[i]["timing_s/step"] for i in idx)
        so = sum(other[i]["timing_s/step"] for i in idx)
        tb = max(1, sum(base[i]["tokens"] for i in idx))
        to = max(1, sum(other[i]["tokens"] for i in idx))
        return so / sb, (so / to) / (sb / tb)

    point = ratios(range(n))
    boot = [ratios([rng.randrange(n) for _ in range(n)]) for _ in range(draws)]
    out = []
    for j in (0, 1):
        vals = sorted(b[j] for b in boot)
        out.append((point[j], vals[int(0.025 * draws)], vals[int(0.975 * draws) - 1]))
    return out[0], out[1]


if __name__ == "__main__":
    main()
