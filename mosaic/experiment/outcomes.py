"""The service family's outcome metrics compared arm against arm, with the training seed as the unit.

A service grid's evaluations log, beside accuracy, the stale-action rate (mutating actions whose arguments
rely on a field an event changed after the agent last saw it, per mutating action) and the share of visits
handled right (docs/service.md). Per arm, each seed's value is the mean over the table's evaluations (an
evaluation whose rollouts changed nothing on the accounts has no stale-action rate and is left out). For each
pair of arms the report compares: the difference of the arms' means, a percentile bootstrap interval over
seeds (each arm's seeds resampled), the permutation test over seeds
(:func:`mosaic.train.stats.seed_permutation_test`), Holm over the table's rows.
"""

from __future__ import annotations

import numpy as np

from mosaic.train.stats import holm, seed_permutation_test

__all__ = ["OUTCOMES", "per_seed", "outcome_pairs", "md_outcomes"]

OUTCOMES = (("env/stale_rate", "stale-action rate"), ("env/visits_correct", "visits handled right"))


def per_seed(seeds: dict, evals: list[str], key: str) -> np.ndarray:
    """Each seed's mean of ``key`` over the evaluations ``evals`` that logged it (the stale-action rate only where
    the rollouts made a mutating action); seeds with none are left out."""
    out = []
    for s in seeds.values():
        vals = []
        for e in evals:
            m = s["evals"][e][1].get("metrics", {}) if e in s["evals"] else {}
            v = m.get(key)
            if isinstance(v, (int, float)) and v == v and not (key == "env/stale_rate" and m.get("env/actions") == 0):
                vals.append(float(v))
        if vals:
            out.append(float(np.mean(vals)))
    return np.array(out)


def outcome_pairs(groups: dict[str, dict], pairs: list[tuple[str, str]], evals: list[str], *, n_boot: int = 4000,
                  seed: int = 0) -> list[dict]:  # fmt: skip
    """Rows ``{a, b, metric, label, diff, lo, hi, p_seeds, p_seeds_holm, seeds_a, seeds_b}`` for every pair of
    group keys and outcome metric where both arms have at least 2 seeds with a value."""
    rows, rng = [], np.random.default_rng(seed)
    for a, b in pairs:
        for key, label in OUTCOMES:
            va, vb = per_seed(groups[a]["seeds"], evals, key), per_seed(groups[b]["seeds"], evals, key)
            if len(va) < 2 or len(vb) < 2:
                continue
            boot = (va[rng.integers(0, len(va), (n_boot, len(va)))].mean(1)
                    - vb[rng.integers(0, len(vb), (n_boot, len(vb)))].mean(1))  # fmt: skip
            lo, hi = np.quantile(boot, [0.025, 0.975])
            rows.append({"a": a, "b": b, "metric": key, "label": label, "diff": float(va.mean() - vb.mean()),
                         "lo": float(lo), "hi": float(hi), "p_seeds": seed_permutation_test(va, vb),
                         "seeds_a": len(va), "seeds_b": len(vb)})  # fmt: skip
    for r, adj in zip(rows, holm([r["p_seeds"] for r in rows])):
        r["p_seeds_holm"] = adj
    return rows


def md_outcomes(rows: list[dict]) -> list[str]:
    """The rows as a markdown table (nothing when there are none)."""
    if not rows:
        return []
    out = ["", "The family's outcomes, arm against arm (**the unit is the training seed**: each seed's mean over "
           "these evaluations; interval: bootstrap over seeds; p: permutation test over the per-seed values, Holm "
           "within this table):", "", "| A − B | outcome | seeds | Δ points [95 % CI] | seed permutation p (Holm) |",
           "|" + " --- |" * 5]  # fmt: skip
    for r in rows:
        out.append(f"| {r['a']} − {r['b']} | {r['label']} | {r['seeds_a']} + {r['seeds_b']} | {100 * r['diff']:+.1f} "
                   f"[{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}] | {r['p_seeds']:.3g} ({r['p_seeds_holm']:.3g}) |")
    return out
