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

The harness side's served model decodes in a worker process (``rollout.worker_process=true``, the default:
:mod:`mosaic.agent.server.procworker`); ``--thread-worker`` adds a third side, the same harness with the model in a
thread of this process, interleaved with the other two, so the two layouts are compared under the same load.

Usage: python bench/harness.py [--steps 3] [--batch-tasks 2] [--group-size 4] [--threads 2] [--thread-worker]
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
    ap.add_argument("--thread-worker", action="store_true",
                    help="a third side: the harness with the served model in a thread (rollout.worker_process=false)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from mosaic.train import setup
    from mosaic.config.loader import load_config
    from mosaic.train.entrypoints import ensure_warm_start
    from mosaic.agent.server.procworker import decodes_in
    from mosaic.train.external import ExternalRollouts
    from mosaic.train.optim import build_optimizer, build_scheduler
    from mosaic.train.rl import RLState, rl_step

    work = Path(tempfile.mkdtemp(prefix="bench-harness-"))
    common = [f"train.batch_tasks={args.batch_tasks}", f"train.group_size={args.group_size}",
              f"algo.estimator={args.estimator}", "train.heldout_split=none", "train.rollout_samples=0",
              f"train.run_dir={work}"]
    served = ["rollout.source=harness", f"rollout.harness={ROOT / 'examples/harness/plain.py'}:run"]
    sides = {"built-in": load_config("cpu", overrides=common),
             "harness": load_config("cpu", overrides=common + served + ["rollout.worker_process=true"])}
    if args.thread_worker:  # the served model in a thread of this process, as before the worker process
        sides["harness-thread"] = load_config("cpu", overrides=common + served + ["rollout.worker_process=false"])
    dev = torch.device("cpu")
    states = {}
    for name, cfg in sides.items():
        model, tok = setup.load_policy(ensure_warm_start(cfg), device=dev, dtype=torch.float32)
        split = setup.load_split(cfg, "train")
        opt = build_optimizer(model, cfg.optim)
        source = ExternalRollouts(cfg, model, tok, split, work / "records") if cfg.rollout.source == "harness" else None
        states[name] = RLState(cfg, model, tok, setup.chat_format(tok), split, opt,
                               build_scheduler(opt, cfg.optim, args.steps), dev, source=source)
        if source is not None:
            srv = source.server
            print(f"{name}: the served model decodes in {decodes_in(srv.worker, srv.worker_fallback)}")
    rows: dict[str, list[dict]] = {n: [] for n in states}
    kinds: dict[str, Counter] = {n: Counter() for n in states}
    served_by = {n: getattr(getattr(st.source, "server", None), "worker", None) for n, st in states.items()}
    cpu = ThreadCPU({n: w.process.pid for n, w in served_by.items() if hasattr(w, "process")})
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
    print("all steps together, ms per sampled token: " + ", ".join(f"{n} {1000 * total[n]:.2f}" for n in rows))
    for side in (n for n in rows if n != "built-in"):
        if all("rollout/served_batch_mean" in r for r in rows[side]):
            print(f"{side} side: the served policy decoded {med(side, 'rollout/served_batches'):.0f} batches per step, "
                  f"{med(side, 'rollout/served_batch_mean'):.2f} sequences each (median over steps); the built-in "
                  f"harness decodes each round's turns of all {len(states['built-in'].last_trajs)} rollouts together")
        print(f"\n{side} / built-in: {med(side, 'timing_s/step') / med('built-in', 'timing_s/step'):.2f}x per step, "
              f"{per_tok[side] / per_tok['built-in']:.2f}x per sampled token (median of the steps; all steps together "
              f"{total[side] / total['built-in']:.2f}x) (target <= 1.1x)")
        step_ci, tok_ci = paired_ratio_intervals(rows["built-in"], rows[side])
        print(f"all steps together with 95 % intervals (paired bootstrap over the {args.steps} interleaved steps): "
              f"{step_ci[0]:.2f}x [{step_ci[1]:.2f}, {step_ci[2]:.2f}] per step, {tok_ci[0]:.2f}x [{tok_ci[1]:.2f}, "
              f"{tok_ci[2]:.2f}] per sampled token")
    if cpu.ok:
        print_generation_split(rows)


def print_generation_split(rows: dict[str, list[dict]]) -> None:
    """The harness side's generation per sampled token: wall time, and CPU time by thread group."""
    def per_token(name: str, key: str) -> float:
        return 1e6 * sum(r.get(key, 0.0) for r in rows[name]) / max(1, sum(r["tokens"] for r in rows[name]))

    for side in (n for n in rows if n != "built-in"):
        parts = ", ".join(f"{label} {per_token(side, 'cpu/' + label):.0f}" for _, label in ThreadCPU.GROUPS)
        print(f"generation per sampled token (us, all steps): built-in {per_token('built-in', 'timing_s/gen'):.0f} "
              f"wall; {side} {per_token(side, 'timing_s/gen'):.0f} wall, CPU by thread: {parts}")


class ThreadCPU:
    """CPU seconds of this process's threads by group (:attr:`GROUPS`, by thread name), and of every thread of
    the served model's worker processes (``workers``: side -> pid) as "model worker", read from ``/proc`` every
    20 ms; ``ok`` is False where there is no ``/proc/self/task`` (then every figure stays 0)."""

    GROUPS = (("mosaic-model-worker", "model worker"), ("mosaic-uvicorn", "server and proxy loops"),
              ("harness-", "harness threads"))

    def __init__(self, workers: dict[str, int] | None = None, every_s: float = 0.02) -> None:
        self.ok = os.path.isdir("/proc/self/task")
        self.tick = os.sysconf("SC_CLK_TCK") if self.ok else 100
        self.workers = list((workers or {}).values())
        self.total: Counter = Counter()
        self.last: dict[tuple, int] = {}
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

    def _ticks(self, pid: str, tid: str) -> int | None:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            return None
        return int(fields[11]) + int(fields[12])  # utime + stime

    def _add(self, key: tuple, label: str | None) -> None:
        ticks = self._ticks(*key)
        if ticks is None:
            return
        delta = ticks - self.last.get(key, ticks)
        self.last[key] = ticks
        if label is not None and delta > 0:
            self.total[label] += delta / self.tick

    def _poll(self) -> None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            name = names.get(int(tid), "")
            self._add(("self", tid), next((lab for prefix, lab in self.GROUPS if name.startswith(prefix)), None))
        for pid in self.workers:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:  # the worker process ended
                continue
            for tid in tids:
                self._add((str(pid), tid), "model worker")


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
