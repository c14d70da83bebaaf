"""Two runs on two cores: one at a time with two intra-op threads, or both at once with one thread each?

``mosaic experiment --jobs N`` gives each unit ``cores / N`` intra-op threads (``OMP_NUM_THREADS``,
``MOSAIC_THREADS`` -> ``torch.set_num_threads``), so N units never oversubscribe the machine. Which N is
faster on a grid is a measurement, not a guess: this script writes a small grid (the compaction preset of
``experiments/compaction.yaml``, shortened: ``--steps`` training steps, one held-out evaluation of
``--questions`` x 2), and runs the same grid with ``--jobs 1`` (each unit 2 threads, one after another)
and ``--jobs 2`` (two units at once, 1 thread each), each into its own fresh work directory, ``--rounds``
times interleaved (1, 2; 2, 1; ...). Prints the grid's wall seconds per setting and the ratio, and checks
that both settings trained the same models (same final held-out accuracy per run: the thread count must
not change results beyond float rounding; a difference is printed, not hidden).

Needs the machine to itself (it measures wall time): pause other jobs first.

    python bench/threads.py                      # 2 seeds x 1 arm + the warm start, 4 steps, 32 questions
    python bench/threads.py --steps 6 --questions 64 --rounds 2
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

import yaml

from mosaic.experiment.runner import usable_cores

REPO = Path(__file__).resolve().parent.parent


def write_grid(path: Path, steps: int, questions: int, seeds: list[int]) -> None:
    base = yaml.safe_load((REPO / "experiments" / "compaction.yaml").read_text())
    common = [o for o in base["common"] if not o.startswith(("train.steps=", "train.save_every="))]
    grid = {"name": "threads-bench", "preset": base["preset"],
            "common": [*common, f"train.steps={steps}", f"train.save_every={steps}"],
            "arms": {"mosaic": ["algo.estimator=mosaic"]}, "seeds": seeds,
            "evals": [{"name": "test", "split": "test", "data_seed": 0, "n_tasks": questions, "samples": 2,
                       "temperature": 0.5}]}  # fmt: skip
    path.write_text(yaml.safe_dump(grid, sort_keys=False))


def run_grid(grid: Path, work: Path, jobs: int, cache: Path) -> float:
    env = dict(os.environ, MOSAIC_CACHE=str(cache))
    cmd = [sys.executable, "-m", "mosaic.cli", "experiment", str(grid), "--work", str(work), "--jobs", str(jobs)]
    t = time.perf_counter()
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    secs = time.perf_counter() - t
    if res.returncode != 0:
        sys.exit(f"threads: the grid failed with --jobs {jobs}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return secs


def accuracies(work: Path) -> dict[str, float]:
    out = {}
    for f in sorted(work.glob("runs/*/evals/*.json")):
        out[f.parent.parent.name.rsplit("-", 1)[0] + "/" + f.stem] = json.loads(f.read_text())["accuracy"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=2, help="runs in the grid (seeds 0..n-1), plus the warm start")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    if min(args.steps, args.questions, args.seeds, args.rounds) < 1:
        ap.error("--steps, --questions, --seeds and --rounds must be >= 1")
    n = usable_cores()
    if n != 2:
        print(f"note: {n} cores here; the comparison is --jobs 1 ({n} threads) vs --jobs 2 ({max(1, n // 2)} each)")
    with tempfile.TemporaryDirectory(prefix="threads-bench-") as d:
        tmp = Path(d)
        grid = tmp / "grid.yaml"
        write_grid(grid, args.steps, args.questions, list(range(args.seeds)))
        secs: dict[int, list[float]] = {1: [], 2: []}
        accs: dict[tuple[int, int], dict[str, float]] = {}  # (jobs, round) -> run/eval -> accuracy
        for k in range(args.rounds):
            for jobs in ((1, 2) if k % 2 == 0 else (2, 1)):
                work = tmp / f"work-j{jobs}-r{k}"
                secs[jobs].append(run_grid(grid, work, jobs, tmp / "cache"))
                accs[(jobs, k)] = accuracies(work)
                print(f"round {k}: --jobs {jobs}: {secs[jobs][-1]:.1f} s", flush=True)
    one, two = statistics.median(secs[1]), statistics.median(secs[2])
    print(f"\ngrid of {args.seeds} runs + warm start ({args.steps} steps, {args.questions} x 2 questions), "
          f"median wall over {args.rounds} round(s):")
    print(f"  --jobs 1 ({n} threads each):           {one:8.1f} s")
    print(f"  --jobs 2 ({max(1, n // 2)} thread(s) each, two at once): {two:8.1f} s")
    print(f"  --jobs 2 is {one / two:.2f}x the speed of --jobs 1")
    first = accs[(1, 0)]
    diff = {f"jobs {j} round {k}": {key: (first.get(key), a.get(key)) for key in sorted(set(first) | set(a))
                                    if first.get(key) != a.get(key)}
            for (j, k), a in accs.items()}
    diff = {name: d for name, d in diff.items() if d}
    print("  held-out accuracies: " + ("identical in every round under both settings" if not diff else
                                       f"differ from --jobs 1's first round (float rounding of the thread count?): "
                                       f"{diff}"))


if __name__ == "__main__":
    main()
