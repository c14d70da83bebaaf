"""Calibration of the interaction test (``mosaic.train.seedinteraction``) on simulated grids.

A grid of four cells (arm A and B under a setting and under the baseline) of ``--seeds`` training runs each,
on ``--questions`` questions shared by every cell (per-question difficulty N(0, 0.12) clipped to +-0.28, so no
probability clips and a planted interaction is exact), a per-run offset of SD ``--run-sd``, ``--samples``
Bernoulli samples per question. Under the null the arms differ by 4 points in both settings and the setting
moves both by 15 points (main effects, no interaction); under the alternative the interaction is
``--effect``. Prints, over ``--reps`` grids: the Welch contrast test's rejection rate at 5 % (null: its
false-positive rate; alternative: its power, beside the power the report prints), and how often the 95 %
nested bootstrap interval misses the true interaction. Then the A/A check's rate on null grids.

    python bench/interaction_calibration.py                     # 10 seeds per cell, 300 grids each
    python bench/interaction_calibration.py --seeds 3 --run-sd 0.04
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mosaic.train.seedinteraction import aa_interaction, interaction  # noqa: E402


def grid(rng, means, seeds, questions, run_sd, samples):
    q = np.clip(rng.normal(0, 0.12, questions), -0.28, 0.28)
    cells = []
    for mu in means:
        p = mu + rng.normal(0, run_sd, (seeds, 1)) + q[None, :]
        cells.append(rng.binomial(samples, np.clip(p, 0, 1)) / samples)
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--questions", type=int, default=384)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--run-sd", type=float, default=0.02)
    ap.add_argument("--effect", type=float, default=0.035)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--n-boot", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if min(args.seeds, args.questions, args.samples, args.reps, args.n_boot) < 1 or args.seeds < 2:
        ap.error("--seeds >= 2 and every count >= 1")
    rng = np.random.default_rng(args.seed)
    print(f"{args.seeds} seeds per cell, {args.questions} questions x {args.samples} samples, run SD "
          f"{100 * args.run_sd:.1f} points, {args.reps} grids per case, n_boot {args.n_boot}")
    for name, inter in (("null (no interaction)", 0.0), (f"interaction {100 * args.effect:+.1f} points", args.effect)):
        means = (0.49 + inter, 0.45, 0.34, 0.30)
        rej = miss = 0
        power = []
        for k in range(args.reps):
            r = interaction(*grid(rng, means, args.seeds, args.questions, args.run_sd, args.samples),
                            n_boot=args.n_boot, seed=k, effect=args.effect)  # fmt: skip
            rej += r.p_welch < 0.05
            miss += not (r.lo <= inter <= r.hi)
            power.append(r.power)
        print(f"  {name:<28} Welch p < 0.05: {100 * rej / args.reps:5.1f} %   interval misses the truth: "
              f"{100 * miss / args.reps:5.1f} %   power the report prints (median): {np.median(power):.2f}")
    if args.seeds >= 4:
        rates = [aa_interaction(*grid(rng, (0.49, 0.34), args.seeds, args.questions, args.run_sd, args.samples),
                                max_pairs=500, seed=k)["rate_welch"]  # fmt: skip
                 for k in range(min(args.reps, 50))]
        print(f"  A/A check on null grids ({len(rates)}): mean rate {100 * np.mean(rates):.1f} %, 5-95 % range "
              f"[{100 * np.quantile(rates, 0.05):.1f}, {100 * np.quantile(rates, 0.95):.1f}] %")


if __name__ == "__main__":
    main()
