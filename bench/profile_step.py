"""Where an RL step's time goes: ``torch.profiler`` over steps of the main job (``mosaic train``'s CPU preset).

Runs one warm-up step, then ``--steps`` profiled steps of ``mosaic.train.rl.rl_step`` with the overrides
given, and prints the step's phases (``timing_s/*``), the top operators by self CPU time and the top
Python call sites (``cProfile``, cumulative), so a change can be checked against the profile it targets.

    python bench/profile_step.py                                  # the main job (compaction, Mosaic)
    python bench/profile_step.py algo.kl_coef=0.05                # with the KL anchor (the compaction grid)
    python bench/profile_step.py harness.mode=single harness.max_turns=1 algo.estimator=grpo
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="mosaic train overrides (key=value)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.steps < 1 or args.top < 1:
        ap.error("--steps and --top must be >= 1")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainer import _our_state
    from mosaic.train.rl import rl_step

    if args.threads:
        torch.set_num_threads(args.threads)
    st = _our_state([f"train.steps={args.steps + 1}", *args.overrides])  # (with the KL anchor's reference when on)
    rl_step(st, 0)  # warm-up
    metrics = []
    prof_py = cProfile.Profile()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        prof_py.enable()
        for k in range(1, args.steps + 1):
            metrics.append(rl_step(st, k))
        prof_py.disable()
    keys = [k for k in metrics[0] if k.startswith("timing_s/")]
    print(f"phases (median of {args.steps} steps, wall s):")
    for k in keys:
        print(f"  {k:<28}{statistics.median(m[k] for m in metrics):8.3f}")
    print()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    out = io.StringIO()
    pstats.Stats(prof_py, stream=out).sort_stats("cumulative").print_stats(args.top * 2)
    print(out.getvalue())


if __name__ == "__main__":
    main()
