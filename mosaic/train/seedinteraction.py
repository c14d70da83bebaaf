"""Does one training arm's lead over another change with the setting? (A difference of differences, with
the training seed as the unit.)

Four independent cells of training runs on the same questions: arm A and arm B under setting 1, and under
setting 2 (for example mosaic and broadcast under context resets, and under compaction). The question
"does Mosaic's credit help more under resets than under compaction" is the contrast
``(A1 - B1) - (A2 - B2)`` of the cells' mean accuracies. :func:`interaction` gives it with a nested
hierarchical bootstrap interval (each cell's seeds resampled, then questions within each seed, as
:func:`mosaic.train.seedstats.hierarchical_bootstrap`) and a Welch-type t-test of the contrast over per-seed
accuracies; :func:`aa_interaction` checks that test on A/A splits (one arm's seeds under each setting split
into halves, where the interaction is 0 by construction). Formulas: ``docs/stats.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mosaic.train.seedstats import (
    PAPER_EFFECT, contrast_welch, half_splits, nested_means, pooled_sd, t_cdf, t_ppf,
)

__all__ = ["Interaction", "interaction", "contrast_power", "aa_interaction"]


@dataclass(frozen=True)
class Interaction:
    """Does arm A's lead over arm B change with the setting? ``(A - B under setting 1) - (A - B under setting
    2)``, four independent cells of training seeds on the same questions; the unit is the training seed."""

    diff: float
    lo: float
    """Hierarchical bootstrap interval (each cell's seeds resampled, then questions within each seed)."""
    hi: float
    p_welch: float
    """Welch-type t-test of the contrast over per-seed accuracies (Welch-Satterthwaite df)."""
    df: float
    seeds: tuple[int, int, int, int]
    """Seeds of A and B under setting 1, then under setting 2."""
    questions: int
    sd: float
    """Pooled seed-to-seed SD over the four cells."""
    power: float
    """Power of a t-test of the contrast (these seed counts, ``sd``) to detect ``effect``."""
    effect: float


def contrast_power(sd: float, seeds: list[int], effect: float = PAPER_EFFECT, alpha: float = 0.05) -> float:
    """Power of the two-sided contrast test at ``alpha`` to detect an interaction of ``effect`` when every cell's
    runs have standard deviation ``sd``: the shifted central t approximation (as
    :func:`mosaic.train.seedstats.seed_power`), ``δ = effect / (sd √Σ 1/S_c)``, with the Welch-Satterthwaite df
    of equal cell variances, ``(Σ 1/S_c)² / Σ (1/S_c)² / (S_c − 1)``. NaN without spread."""
    if not sd > 0:
        return float("nan")
    inv = [1 / n for n in seeds]
    df = sum(inv) ** 2 / sum(v**2 / (n - 1) for v, n in zip(inv, seeds))
    ncp = abs(effect) / (sd * math.sqrt(sum(inv)))
    tc = t_ppf(1 - alpha / 2, df)
    return float(1 - t_cdf(tc - ncp, df) + t_cdf(-tc - ncp, df))


def interaction(a1, b1, a2, b2, *, ci: float = 0.95, n_boot: int = 4000, seed: int = 0,
                effect: float = PAPER_EFFECT, alpha: float = 0.05) -> Interaction:  # fmt: skip
    """``(mean(a1) - mean(b1)) - (mean(a2) - mean(b2))`` for four (S_c, Q) matrices on the same questions
    (arm A and B under setting 1, then under setting 2): the estimate, its nested bootstrap interval (as
    :func:`hierarchical_bootstrap` with ``questions="within"``, over four cells), and a Welch-type test of the
    contrast of per-seed accuracies. ``power``: of that test to detect an interaction of ``effect``
    (:func:`contrast_power`; the default ``effect`` is the paper's main compaction effect, for scale)."""
    cells = [np.asarray(x, dtype=np.float64) for x in (a1, b1, a2, b2)]
    if any(c.ndim != 2 for c in cells) or len({c.shape[1] for c in cells}) != 1 or cells[0].shape[1] == 0:
        raise ValueError(f"need four (S, Q) matrices on the same questions, got {[c.shape for c in cells]}")
    if any(c.shape[0] < 2 for c in cells):
        raise ValueError(f"every cell needs at least 2 seeds, got {[c.shape[0] for c in cells]}")
    if not all(np.isfinite(c).all() for c in cells):
        raise ValueError("the per-question outcomes must be finite numbers (a NaN or inf in a cell)")
    signs = (1.0, -1.0, -1.0, 1.0)
    rng, boot = np.random.default_rng(seed), np.empty(n_boot)
    for lo in range(0, n_boot, 500):
        m = min(500, n_boot - lo)
        boot[lo : lo + m] = sum(s * nested_means(c, m, rng) for s, c in zip(signs, cells))
    lo_, hi_ = np.quantile(boot, [(1 - ci) / 2, (1 + ci) / 2])
    means = [c.mean(1) for c in cells]
    p, df = contrast_welch(means, signs)
    sd = pooled_sd(*cells)
    power = contrast_power(sd, [len(m) for m in means], effect, alpha)
    return Interaction(float(sum(s * m.mean() for s, m in zip(signs, means))), float(lo_), float(hi_), float(p),
                       float(df), tuple(len(m) for m in means), cells[0].shape[1], sd, power, effect)  # fmt: skip


def aa_interaction(x, y, *, alpha: float = 0.05, max_pairs: int = 4000, seed: int = 0) -> dict[str, float]:
    """A/A calibration of :func:`interaction`'s test: one arm under two settings, ``x`` (S_x, Q) and ``y``
    (S_y, Q), each split into equal halves (:func:`half_splits`), and ``(x_1 - x_2) - (y_1 - y_2)`` tested
    as if the halves were two arms; every pair of splits (``max_pairs`` random pairs when there are more).
    The interaction is 0 by construction: the share with p < ``alpha`` is the test's false-positive rate."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"need two (S, Q) matrices on the same questions, got {x.shape} and {y.shape}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("the per-question outcomes must be finite numbers (a NaN or inf in a cell)")
    x, y = x.mean(1), y.mean(1)
    if min(len(x), len(y)) < 4:
        raise ValueError(f"A/A of the interaction needs at least 4 seeds per setting, got {len(x)} and {len(y)}")
    (xa, xb), (ya, yb) = half_splits(len(x)), half_splits(len(y))
    i, j = np.meshgrid(np.arange(len(xa)), np.arange(len(ya)), indexing="ij")
    i, j = i.ravel(), j.ravel()
    if len(i) > max_pairs:
        pick = np.random.default_rng(seed).choice(len(i), max_pairs, replace=False)
        i, j = i[pick], j[pick]
    cells = [np.stack([x[m] for m in xa])[i], np.stack([x[m] for m in xb])[i],
             np.stack([y[m] for m in ya])[j], np.stack([y[m] for m in yb])[j]]  # fmt: skip
    p, _ = contrast_welch(cells, (1.0, -1.0, -1.0, 1.0))
    return {"pairs": int(len(i)), "rate_welch": float((p < alpha).mean()), "seeds": (len(x), len(y))}
