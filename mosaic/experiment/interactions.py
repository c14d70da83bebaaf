"""The report's tables across settings: pairs of settings compared arm by arm (the grid's ``contrasts``), and
whether one arm's lead over another changes with the setting.

:func:`baseline_ablations`: each setting against the grid's ``baseline`` setting, arm by arm.
:func:`setting_contrasts`: for each ``[A, B]`` of the grid's ``contrasts`` and each arm evaluated on the same
questions under both, A − B as any pair of arms is compared (:func:`mosaic.train.seedstats.compare_seeds`: the
seed as the unit).
:func:`interaction_table`: for a grid with a ``baseline`` setting and at least two arms (``experiments/reset-compare.yaml``: broadcast and
mosaic under compaction, single, and resets), each other setting ``S`` and each pair of arms ``A``, ``B``
evaluated on the same questions in ``S`` and in the baseline give
``(A − B under S) − (A − B under the baseline)``, with the training seed as the unit
(:func:`mosaic.train.seedinteraction.interaction`: nested bootstrap interval over four cells of seeds, a
Welch-type test of the contrast, Holm over the table's rows) and an A/A line: each arm's seeds under ``S`` and
under the baseline split into halves, where the interaction is 0 by construction
(:func:`~mosaic.train.seedinteraction.aa_interaction`).
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from mosaic.train.seedinteraction import aa_interaction, interaction
from mosaic.train.seedstats import compare_seeds
from mosaic.train.stats import holm

__all__ = ["baseline_ablations", "setting_contrasts", "interaction_table", "md_interactions", "MIN_SEEDS"]

MIN_SEEDS = 4
"""Seeds every cell of an interaction needs (at least the 4 the A/A check's halves need): with 2-3 per cell the
nested bootstrap interval misses a true 0 in 5-13 % of simulated grids and the test has almost no power
(docs/stats.md)."""


def _cells(arms: dict[str, dict], mats: dict[str, np.ndarray], min_seeds: int = 1
           ) -> tuple[dict[tuple[str, str], str], list[str]]:
    """``{(arm, setting): key}`` of the groups with at least ``min_seeds`` seeds, and the arm names in order."""
    cell = {(r["arm"], r["setting"]): k for k, r in arms.items() if mats[k].shape[0] >= min_seeds}
    return cell, list(dict.fromkeys(r["arm"] for r in arms.values()))


def _compare(pairs, mats: dict[str, np.ndarray], qsets: dict[str, list[str]], tag: str) -> list[dict]:
    """``{"a", "b", tag: True, **SeedComparison}`` for each ``(a, b)`` of group keys on the same questions."""
    return [{"a": a, "b": b, tag: True, **asdict(compare_seeds(mats[a], mats[b]))}
            for a, b in pairs if qsets[a] == qsets[b]]


def baseline_ablations(arms: dict[str, dict], mats: dict[str, np.ndarray], qsets: dict[str, list[str]],
                       baseline: str | None) -> list[dict]:
    """Each setting against the ``baseline`` setting, arm by arm (same questions, other runs): pairs
    ``{"a", "b", "vs_baseline", **SeedComparison}`` (Holm is the caller's)."""
    if not baseline:
        return []
    cell, _ = _cells(arms, mats)
    pairs = [(a, cell[r["arm"], baseline]) for a, r in arms.items()
             if r["setting"] != baseline and (r["arm"], baseline) in cell]
    return _compare(pairs, mats, qsets, "vs_baseline")


def setting_contrasts(arms: dict[str, dict], mats: dict[str, np.ndarray], qsets: dict[str, list[str]],
                      contrasts) -> list[dict]:
    """Pairs ``{"a", "b", "contrast", **SeedComparison}`` of one arm under two settings, for each ``(A, B)`` of
    ``contrasts`` and each arm with runs under both on the same questions (Holm is the caller's)."""
    cell, names = _cells(arms, mats)
    pairs = [(cell[arm, sa], cell[arm, sb]) for sa, sb in contrasts for arm in names
             if (arm, sa) in cell and (arm, sb) in cell]
    return _compare(pairs, mats, qsets, "contrast")


def interaction_table(arms: dict[str, dict], mats: dict[str, np.ndarray], qsets: dict[str, list[str]],
                      baseline: str | None) -> dict | None:
    """Rows of the interaction table and its A/A check from a report table's ``arms`` (key -> row with
    ``arm`` and ``setting``), per-seed matrices ``mats`` and question ids ``qsets``; None when the grid has no
    baseline or no pair of arms in a second setting. Cells need :data:`MIN_SEEDS` seeds (also what the A/A
    check's halves need)."""
    if not baseline:
        return None
    cell, names = _cells(arms, mats, MIN_SEEDS)
    settings = [s for s in dict.fromkeys(r["setting"] for r in arms.values()) if s != baseline]
    rows, aa = [], {}
    for s in settings:
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                keys = [cell.get(x) for x in ((a, s), (b, s), (a, baseline), (b, baseline))]
                if None in keys or len({tuple(qsets[k]) for k in keys}) != 1:
                    continue
                rows.append({"a": a, "b": b, "setting": s, "baseline": baseline,
                             **asdict(interaction(*(mats[k] for k in keys)))})
        for a in names:
            ks, kb = cell.get((a, s)), cell.get((a, baseline))
            if ks and kb and qsets[ks] == qsets[kb]:
                aa[f"{a}: {s} vs {baseline}"] = aa_interaction(mats[ks], mats[kb])
    if not rows:
        return None
    for r, adj in zip(rows, holm([r["p_welch"] for r in rows])):
        r["p_welch_holm"] = adj
    return {"rows": rows, "aa": aa}


def md_interactions(t: dict | None) -> list[str]:
    """The table in markdown (nothing when ``t`` is None)."""
    if not t:
        return []
    eff = 100 * t["rows"][0]["effect"]
    out = ["", "Does an arm's lead change with the setting? **(A − B under the setting) − (A − B under the "
           "baseline)**, A and B in the grid's order of arms, same questions, four cells of separate training "
           f"runs (at least {MIN_SEEDS} seeds each); **the unit is the training seed**: the p is a Welch-type "
           "t-test of the contrast of per-seed accuracies (Welch–Satterthwaite df; Holm within this table), "
           "conditional on these questions; the interval resamples each cell's seeds, then the questions within "
           "each seed (nested bootstrap), so it also covers new questions and runs wider than the test. Power: "
           f"of the test (shifted-t approximation, the cells' pooled seed SD) to detect an interaction of "
           f"±{eff:.1f} points (the paper's compaction effect, for scale).", "",
           "| A − B | setting vs baseline | seeds (A, B; A, B) | interaction, points [95 % CI] | Welch p (Holm) | "
           "df | seed SD (points) | power |", "|" + " --- |" * 8]  # fmt: skip
    for r in t["rows"]:
        sd = r["seeds"]
        power = f"{r['power']:.2f}" if r["power"] == r["power"] else "–"
        out.append(f"| {r['a']} − {r['b']} | {r['setting']} vs {r['baseline']} | {sd[0]}, {sd[1]}; {sd[2]}, {sd[3]} | "
                   f"{100 * r['diff']:+.1f} [{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}] | {r['p_welch']:.3g} "
                   f"({r['p_welch_holm']:.3g}) | {r['df']:.1f} | {100 * r['sd']:.1f} | {power} |")  # fmt: skip
    if t["aa"]:
        rates = "; ".join(f"{k} {100 * c['rate_welch']:.1f} % of {c['pairs']}" for k, c in t["aa"].items())
        n = sum(c["pairs"] for c in t["aa"].values())
        pooled = sum(c["rate_welch"] * c["pairs"] for c in t["aa"].values()) / n
        out += ["", f"A/A check of the test's p (not of the interval): one arm's seeds under the setting and under "
                f"the baseline, each split into halves, the halves' interaction tested (its true value is 0); "
                f"share of split pairs with p < 0.05: {rates}; all: {100 * pooled:.1f} %. A valid test stays near "
                f"5 % (below with halves of 2 seeds, where it is conservative); one such figure varies by about "
                f"±2.5 points from grid to grid."]  # fmt: skip
    else:
        out += ["", "A/A check of this test: none here (it needs an arm with at least 4 seeds in both settings)."]
    return out
