"""Two training arms compared with the training seed as the unit (issue 28).

"Does estimator A train better models than estimator B" is a question about training runs: every
per-question outcome of one run shares that run's weights, so the questions of a comparison are not
independent draws of it. The inputs are ``(S, Q)`` matrices of per-question mean outcomes, one row per
training seed, every row on the same ``Q`` questions (a crossed design). This module gives:

- :func:`seed_permutation_test`: exact permutation test over seeds (every split of the pooled runs;
  random splits beyond ``max_exact``);
- :func:`welch_test`: Welch's t-test over per-seed accuracies (Student t without scipy);
- :func:`hierarchical_bootstrap`: interval of ``acc(A) - acc(B)`` resampling seeds, then questions;
- :func:`seed_power` / :func:`seeds_for_power`: power of the seed-level test for a given effect from
  the measured seed-to-seed SD, and the seeds per arm needed for 80 %;
- :func:`aa_calibration`: split one arm's seeds into halves every possible way and count how often each
  test calls the arm different from itself (a valid test stays near ``alpha``);
- :func:`compare_seeds`: all of it for one pair of arms, with the question-level sign test kept and
  labelled as what it is — conditional on the trained models.

Formulas: ``docs/stats.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from statistics import NormalDist

import numpy as np

from mosaic.train.stats import seed_permutation_test, sign_flip_test, sign_test  # noqa: F401  (re-exported)

__all__ = ["PAPER_EFFECT", "betainc", "t_cdf", "t_ppf", "welch_test", "seed_permutation_test",
           "min_permutation_p", "hierarchical_bootstrap", "nested_means", "contrast_welch", "seed_power", "seeds_for_power", "half_splits",
           "AACalibration", "aa_calibration", "SeedComparison", "compare_seeds", "vs_reference", "pooled_sd",
           "seed_matrices", "format_seed_comparison"]  # fmt: skip

PAPER_EFFECT = 0.035
"""The paper's Mosaic − broadcast difference under compaction (docs/algorithm.md §8), as a fraction."""
_TINY = 1e-300


def _betacf(a: np.ndarray, b: np.ndarray, x: np.ndarray, iters: int = 400) -> np.ndarray:
    """Continued fraction of the incomplete beta function (modified Lentz), vectorised."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = np.ones_like(x)
    d = 1.0 - qab * x / qap
    d = 1.0 / np.where(np.abs(d) < _TINY, _TINY, d)
    h = d.copy()
    for m in range(1, iters + 1):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / np.where(np.abs(d) < _TINY, _TINY, d)
            c = 1.0 + aa / c
            c = np.where(np.abs(c) < _TINY, _TINY, c)
            step = d * c
            h = h * step
        if np.all(np.abs(step - 1.0) < 1e-15):  # converged everywhere
            break
    return h


def betainc(a, b, x) -> np.ndarray:
    """Regularised incomplete beta ``I_x(a, b)`` (``scipy.special.betainc``), vectorised, a, b > 0."""
    a, b, x = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (a, b, x)))
    x = np.clip(x, 0.0, 1.0)
    inner = (x > 0) & (x < 1)
    xs = np.where(inner, x, 0.5)
    lbeta = np.vectorize(math.lgamma)(a + b) - np.vectorize(math.lgamma)(a) - np.vectorize(math.lgamma)(b)
    front = np.exp(lbeta + a * np.log(xs) + b * np.log1p(-xs))
    direct = xs < (a + 1.0) / (a + b + 2.0)  # where the fraction converges fast; else the symmetry
    val = np.where(direct, front * _betacf(a, b, xs) / a, 1.0 - front * _betacf(b, a, 1.0 - xs) / b)
    return np.where(inner, val, np.where(x <= 0, 0.0, 1.0))


def t_cdf(t, df) -> np.ndarray:
    """Student t CDF (``scipy.stats.t.cdf``)."""
    t, df = np.broadcast_arrays(np.asarray(t, dtype=np.float64), np.asarray(df, dtype=np.float64))
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return np.where(t < 0, tail, 1.0 - tail)


@lru_cache(maxsize=4096)
def t_ppf(p: float, df: float) -> float:
    """Student t quantile (bisection on :func:`t_cdf`; cached)."""
    lo, hi = -1e3, 1e3
    for _ in range(64):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(t_cdf(mid, df)) < p else (lo, mid)
    return (lo + hi) / 2


def contrast_welch(means: list[np.ndarray], signs: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided p and Welch-Satterthwaite df of the contrast ``sum_c signs[c] * mean(cell c)`` of independent
    cells, over the last axis of each ``means[c]`` (..., S_c); vectorised over the leading axes. Two cells with
    signs (1, -1) are Welch's two-sample test. Every cell without spread: the contrast is exact, p 1 when it
    is 0 up to the rounding of the means, else 0."""
    parts = [m.var(-1, ddof=1) / m.shape[-1] for m in means]
    est = sum(s * m.mean(-1) for s, m in zip(signs, means))
    se2 = sum(parts)
    with np.errstate(divide="ignore", invalid="ignore"):
        df = se2**2 / sum(v**2 / (m.shape[-1] - 1) for v, m in zip(parts, means))
        t2 = est**2 / se2
        p = betainc(np.where(se2 > 0, df, 1.0) / 2.0, 0.5, np.where(se2 > 0, df / (df + t2), 1.0))
    tol = 1e-12 * (1 + sum(np.abs(m).max(-1) for m in means))
    return np.where(se2 > 0, p, np.where(np.abs(est) > tol, 0.0, 1.0)), df


def _welch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two-sided Welch p over the last axis of ``a`` (..., S_a) and ``b`` (..., S_b)."""
    return contrast_welch([a, b], (1.0, -1.0))[0]


def welch_test(a, b) -> float:
    """Welch's two-sided t-test of per-seed accuracies (``scipy.stats.ttest_ind(equal_var=False)``);
    NaN with fewer than 2 seeds on a side."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    return float(_welch(a, b))


def min_permutation_p(n_a: int, n_b: int) -> float:
    """The smallest p the exact two-sided permutation test can give (no ties): 1/C(n, n_a), doubled
    when the arms are the same size (a split and its mirror give the same |difference|)."""
    return (2 if n_a == n_b else 1) / math.comb(n_a + n_b, n_a)


def hierarchical_bootstrap(a, b, *, ci: float = 0.95, n_boot: int = 4000, seed: int = 0,
                           questions: str = "within", chunk: int = 500) -> tuple[float, float]:  # fmt: skip
    """Percentile interval of ``mean(a) - mean(b)`` for (S_a, Q) and (S_b, Q) matrices: each replicate
    resamples each arm's seeds (with replacement), then the questions. ``within`` (default): a separate
    question draw for every resampled seed (the nested, hierarchical form; the more conservative one, and
    the one whose A/A rate stayed at or under 5 % on the compaction records); ``shared``: one question
    draw per replicate for every seed of both arms (the crossed form: question difficulty cancels in the
    difference as it does in the data; slightly narrower). ``b`` with one row (the warm start, one model)
    is not resampled over seeds."""
    A, B = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[1]:
        raise ValueError(f"need (S, Q) matrices on the same questions, got {A.shape} and {B.shape}")
    if questions not in ("shared", "within"):
        raise ValueError(f"questions must be 'shared' or 'within', got {questions!r}")
    rng, q = np.random.default_rng(seed), A.shape[1]
    boot = np.empty(n_boot)
    for lo in range(0, n_boot, chunk):
        m = min(chunk, n_boot - lo)
        if questions == "shared":
            wa, wb, wq = _weights(rng, m, A.shape[0]), _weights(rng, m, B.shape[0]), _weights(rng, m, q)
            boot[lo : lo + m] = ((wa @ A - wb @ B) * wq).sum(1)
        else:
            boot[lo : lo + m] = nested_means(A, m, rng) - nested_means(B, m, rng)
    lo_, hi_ = np.quantile(boot, [(1 - ci) / 2, (1 + ci) / 2])
    return float(lo_), float(hi_)


def _weights(rng, m: int, n: int) -> np.ndarray:
    """(m, n) bootstrap weights: row i holds how often each of n units was drawn (n draws), divided by n."""
    if n == 1:
        return np.ones((m, 1))
    flat = (np.arange(m)[:, None] * n + rng.integers(0, n, size=(m, n))).ravel()
    return np.bincount(flat, minlength=m * n).reshape(m, n) / n


def nested_means(x: np.ndarray, m: int, rng) -> np.ndarray:
    """``m`` nested bootstrap means of ``x`` (S, Q): seeds resampled, then questions within each seed."""
    s, q = x.shape
    rows = x[rng.integers(0, s, size=(m, s))] if s > 1 else np.broadcast_to(x, (m, 1, q))  # (m, S, Q)
    wq = _weights(rng, m * rows.shape[1], q).reshape(m, rows.shape[1], q)
    return (rows * wq).sum(2).mean(1)


def seed_power(sd: float, n_a: int, n_b: int, effect: float = PAPER_EFFECT, alpha: float = 0.05) -> float:
    """Power of a two-sided seed-level test at ``alpha`` to detect ``effect`` between arms of ``n_a`` and
    ``n_b`` seeds whose runs' accuracies have standard deviation ``sd``: the two-sample t-test's power with
    the shifted central t approximation, ``1 - F(t_c - δ) + F(-t_c - δ)``, ``δ = effect / (sd √(1/n_a + 1/n_b))``,
    ``F`` the t CDF with ``n_a + n_b - 2`` degrees of freedom. 0 when the exact permutation test cannot
    reach ``alpha`` at these sizes (:func:`min_permutation_p`)."""
    if n_a < 2 or n_b < 2 or not sd == sd:
        return float("nan")
    if min_permutation_p(n_a, n_b) >= alpha:
        return 0.0
    if sd <= 0:
        return 1.0
    df = n_a + n_b - 2
    ncp = abs(effect) / (sd * math.sqrt(1 / n_a + 1 / n_b))
    tc = t_ppf(1 - alpha / 2, df)
    return float(1 - t_cdf(tc - ncp, df) + t_cdf(-tc - ncp, df))


def seeds_for_power(sd: float, effect: float = PAPER_EFFECT, power: float = 0.8, alpha: float = 0.05,
                    max_seeds: int = 10_000) -> int:  # fmt: skip
    """Smallest number of seeds per arm (equal arms) at which :func:`seed_power` reaches ``power``."""
    if not sd == sd:
        return -1
    if sd <= 0:
        return 4  # the exact test's smallest p first falls below 0.05 at 4 + 4 seeds
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    n = max(2, min(max_seeds, math.ceil(2 * (z * sd / abs(effect)) ** 2)))  # the normal approximation, then walk
    while n > 2 and seed_power(sd, n - 1, n - 1, effect, alpha) >= power:
        n -= 1
    while n <= max_seeds and seed_power(sd, n, n, effect, alpha) < power:
        n += 1
    return n if n <= max_seeds else -1


def vs_reference(x, ref) -> float:
    """Exact two-sided sign-flip test over seeds of ``x`` (S, Q) against one fixed model ``ref`` (Q,) on
    the same questions (the warm start): the per-seed differences' mean is 0. With 5 seeds its
    smallest p is 2/32."""
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return sign_flip_test(x.mean(1) - ref.mean())


# ----------------------------------------------------------------------------- A/A and the comparison


def half_splits(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every unordered split of ``n`` seeds into two equal halves of ``n // 2``: masks ``(N, n)`` of the
    first half and of the second (with ``n`` odd, each seed is left out in turn and the other ``n - 1``
    are split; a seed in neither half is False in both). Equal halves: with unequal ones the per-question
    difference is not symmetric about 0 even with no seed effect, and the sign test would be biased
    for that reason alone."""
    k = n // 2
    first, second = [], []
    for out in ([None] if n % 2 == 0 else range(n)):
        rest = [i for i in range(n) if i != out]
        for c in combinations(rest, k):
            if c[0] != rest[0]:  # unordered: the half holding the first seed is listed first
                continue
            m1, m2 = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
            m1[list(c)] = True
            m2[[i for i in rest if i not in c]] = True
            first.append(m1)
            second.append(m2)
    return np.array(first), np.array(second)


def _sign_p(d: np.ndarray) -> np.ndarray:
    """Vectorised :func:`mosaic.train.stats.sign_test` over the rows of ``d`` (N, Q):
    ``min(1, 2 P(X <= min(w, n - w)))``, ``X ~ Bin(n, 1/2)``, ``P(X <= k) = I_{1/2}(n - k, k + 1)``."""
    w, n = (d > 0).sum(1), (d != 0).sum(1)
    k = np.minimum(w, n - w)
    cdf = betainc(np.maximum(n - k, 1), k + 1, 0.5)
    return np.where((n == 0) | (2 * k == n), 1.0, np.minimum(1.0, 2 * cdf))


@dataclass(frozen=True)
class AACalibration:
    """One arm against itself: its seeds split into halves every possible way."""

    seeds: int
    splits: int
    halves: tuple[int, int]
    rate_seeds: float
    """Share of splits where the exact seed permutation test gives p < alpha."""
    rate_welch: float
    rate_sign: float
    """Question-level sign test (conditional on the trained models)."""
    rate_interval: float
    """Share of splits whose hierarchical bootstrap interval excludes 0 (NaN when not computed)."""
    min_p_seeds: float
    alpha: float


def aa_calibration(x, *, alpha: float = 0.05, interval_splits: int = 50, n_boot: int = 1000,
                   seed: int = 0, chunk: int = 2000) -> AACalibration:  # fmt: skip
    """A/A calibration of an arm's (S, Q) matrix, S >= 4: every split of its seeds into equal halves
    (:func:`half_splits`) is compared as if the halves were two arms, with each test; the share of splits
    with p < ``alpha`` is that test's false-positive rate on these records. A split's exact permutation p
    is its rank among the splits of the same seeds (all of them are its reference set). The bootstrap
    interval is checked on ``interval_splits`` splits spread evenly (all when fewer), ``n_boot`` each."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    if n < 4:
        raise ValueError(f"A/A calibration needs at least 4 seeds, got {n}")
    m1, m2 = half_splits(n)
    k = n // 2
    per_seed = x.mean(1)
    a = np.stack([per_seed[m] for m in m1])  # (N, k)
    b = np.stack([per_seed[m] for m in m2])
    stat = np.abs(a.mean(1) - b.mean(1))
    used = (m1 | m2).argmin(1) if n % 2 else np.zeros(len(m1), dtype=int)  # the seed left out: the reference set
    p_perm = np.empty(len(stat))
    for g in np.unique(used):
        sel = used == g
        srt = np.sort(stat[sel])
        below = np.searchsorted(srt, stat[sel] - (1e-12 + 1e-9 * stat[sel]), side="left")
        p_perm[sel] = (sel.sum() - below) / sel.sum()  # splits at least as extreme (not 1 - x: exact ratios)
    p_welch = _welch(a, b)
    p_sign = np.concatenate([_sign_p((m1[i : i + chunk].astype(float) @ x - m2[i : i + chunk].astype(float) @ x) / k)
                             for i in range(0, len(m1), chunk)])  # fmt: skip
    rate_interval = float("nan")
    if interval_splits > 0:
        pick = np.unique(np.linspace(0, len(m1) - 1, min(interval_splits, len(m1))).round().astype(int))
        excl = [not (lo <= 0 <= hi) for lo, hi in
                (hierarchical_bootstrap(x[m1[i]], x[m2[i]], n_boot=n_boot, seed=seed + i) for i in pick)]
        rate_interval = float(np.mean(excl))
    return AACalibration(n, len(m1), (k, k), float((p_perm < alpha).mean()), float((p_welch < alpha).mean()),
                         float((p_sign < alpha).mean()), rate_interval, min_permutation_p(k, k), alpha)  # fmt: skip


@dataclass(frozen=True)
class SeedComparison:
    """Arm A − arm B on the same questions; the unit is the training seed."""

    diff: float
    lo: float
    """Hierarchical bootstrap interval (seeds, then questions)."""
    hi: float
    p_seeds: float
    """Exact permutation test over per-seed accuracies: the headline test."""
    p_welch: float
    p_sign: float
    """Exact sign test on seed-averaged per-question differences: conditional on the trained models."""
    wins: int
    losses: int
    ties: int
    seeds_a: int
    seeds_b: int
    questions: int
    sd: float
    """Pooled seed-to-seed standard deviation of one run's accuracy."""
    power: float
    """Power of the seed-level test (these seed counts, ``sd``) to detect ``effect``."""
    seeds_needed: int
    """Seeds per arm for 80 % power to detect ``effect`` (-1: beyond 10,000)."""
    effect: float
    min_p_seeds: float


def pooled_sd(*arms: np.ndarray) -> float:
    """Pooled standard deviation of per-seed accuracies over the arms' (S, Q) matrices (NaN when no arm has 2
    seeds)."""
    means = [a.mean(1) for a in arms]
    dof = sum(len(m) - 1 for m in means)
    if dof <= 0:
        return float("nan")
    return math.sqrt(sum(((m - m.mean()) ** 2).sum() for m in means if len(m) > 1) / dof)


def compare_seeds(a, b, *, ci: float = 0.95, n_boot: int = 4000, seed: int = 0, effect: float = PAPER_EFFECT,
                  alpha: float = 0.05, power: float = 0.8) -> SeedComparison:  # fmt: skip
    """Paired (same questions) comparison of two arms' (S_a, Q) and (S_b, Q) per-question means."""
    A, B = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[1]:
        raise ValueError(f"arms must be evaluated on the same questions: {A.shape} vs {B.shape}")
    lo, hi = hierarchical_bootstrap(A, B, ci=ci, n_boot=n_boot, seed=seed)
    d = A.mean(0) - B.mean(0)
    sd = pooled_sd(A, B)
    return SeedComparison(
        diff=float(d.mean()), lo=lo, hi=hi, p_seeds=seed_permutation_test(A.mean(1), B.mean(1)),
        p_welch=welch_test(A.mean(1), B.mean(1)), p_sign=sign_test(d), wins=int((d > 0).sum()),
        losses=int((d < 0).sum()), ties=int((d == 0).sum()), seeds_a=A.shape[0], seeds_b=B.shape[0],
        questions=A.shape[1], sd=sd, power=seed_power(sd, A.shape[0], B.shape[0], effect, alpha),
        seeds_needed=seeds_for_power(sd, effect, power, alpha), effect=effect,
        min_p_seeds=min_permutation_p(A.shape[0], B.shape[0]))  # fmt: skip


# ----------------------------------------------------------------------------- outcome files (mosaic compare)


def seed_matrices(paths_a, paths_b, *, on_mismatch: str = "error") -> tuple[list[str], np.ndarray, np.ndarray]:
    """(S_a, Q) and (S_b, Q) per-question means from one outcome file per training run (seed), aligned on
    the question ids every file has (``on_mismatch='error'``: they must all have the same ones)."""
    from mosaic.train.stats import load_outcomes

    runs = [load_outcomes(p) for p in [*paths_a, *paths_b]]
    common = set.intersection(*(set(r) for r in runs))
    if any(set(r) != common for r in runs):
        msg = (f"the outcome files cover different questions ({len(common)} in every file, "
               f"{max(len(r) for r in runs)} in the largest)")  # fmt: skip
        if on_mismatch == "error":
            raise ValueError(msg + "; pass on_mismatch='intersect' to compare the common ones")
    if not common:
        raise ValueError("no question in common")
    ids = sorted(common)
    mat = np.array([[float(np.mean(r[q])) for q in ids] for r in runs])
    return ids, mat[: len(paths_a)], mat[len(paths_a) :]


def format_seed_comparison(c: SeedComparison, aa: dict[str, AACalibration], name_a: str = "A",
                           name_b: str = "B") -> str:  # fmt: skip
    """What ``mosaic compare`` prints for several runs per arm."""
    pct = lambda x: f"{100 * x:.2f}"  # noqa: E731
    floor = f" (the smallest p possible with {c.seeds_a} + {c.seeds_b} seeds is {c.min_p_seeds:.3g})" \
        if c.min_p_seeds >= 0.05 else ""  # fmt: skip
    need = c.seeds_needed if c.seeds_needed > 0 else "more than 10,000"
    lines = [
        f"unit: training seeds ({c.seeds_a} runs of {name_a}, {c.seeds_b} of {name_b}), each on the same "
        f"{c.questions} questions",
        f"difference ({name_a} - {name_b}): {pct(c.diff)} points, 95% CI [{pct(c.lo)}, {pct(c.hi)}] "
        f"(hierarchical bootstrap: seeds, then questions)",
        f"{'exact' if math.comb(c.seeds_a + c.seeds_b, c.seeds_a) <= 200_000 else 'Monte Carlo (100,000 random splits)'} "
        f"permutation test over seeds: p = {c.p_seeds:.4g}{floor}; Welch over seeds: p = {c.p_welch:.4g}",
        f"power of the seed test to detect {100 * c.effect:.1f} points: {c.power:.2f} (seed-to-seed SD "
        f"{pct(c.sd)} points); seeds per arm for 80 %: {need}",
        f"conditional on these trained models (questions as the unit): exact sign test p = {c.p_sign:.4g}; "
        f"{name_a} better on {c.wins}, {name_b} on {c.losses}, tied {c.ties}",
    ]  # fmt: skip
    for name, r in aa.items():
        lines.append(f"A/A {name} ({r.seeds} seeds, {r.splits} splits into {r.halves[0]} v {r.halves[1]}): p < 0.05 "
                     f"in {100 * r.rate_seeds:.1f} % (seed permutation), {100 * r.rate_welch:.1f} % (Welch), "
                     f"{100 * r.rate_sign:.1f} % (question sign test)")  # fmt: skip
    return "\n".join(lines)
