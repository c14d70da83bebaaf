"""Accuracy with confidence intervals, and paired comparisons of two runs.

The paper reports no seeds or intervals (docs/algorithm.md §8); this project does. Outcomes
are per question, possibly several samples (or seeds) per question: an array
``(Q,)`` or ``(Q, R)``, with NaN for missing samples. Questions are the unit of
resampling (samples of one question are not independent), so:

- :func:`accuracy_ci`: Wilson interval when each question has one sample,
  otherwise a bootstrap over questions;
- :func:`paired_bootstrap`: CI of ``acc(A) - acc(B)`` on the **same** questions,
  resampling questions and keeping each question's pair together (much tighter
  than two independent intervals, because question difficulty cancels);
- :func:`compare_outcome_files`: the same from two outcome files.

Everything is seeded (``numpy.random.default_rng(seed)``) and vectorised; the
bootstrap runs in chunks to bound memory.

Outcome files (JSONL, one record per question sample): an id field
(``question_id``, ``task_id`` or ``id``) and an outcome field (``correct``,
``success``, ``reward`` or ``score``; booleans count as 0/1). A JSON object
``{question_id: outcome or [outcomes]}`` is accepted too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Literal

import numpy as np
from statistics import NormalDist

__all__ = ["wilson_ci", "accuracy_ci", "AccuracyCI", "paired_bootstrap", "PairedComparison",
           "load_outcomes", "align_outcomes", "compare_outcome_files", "format_comparison", "sign_test",
           "sign_flip_test", "seed_permutation_test", "holm", "seed_question_ci", "SeedCI", "compare_arms",
           "ArmComparison", "detectable_difference", "Power"]  # fmt: skip

ID_KEYS = ("question_id", "task_id", "id")
VALUE_KEYS = ("correct", "success", "reward", "score")


def _z(ci: float) -> float:

    if not 0 < ci < 1:
        raise ValueError(f"ci must be in (0, 1), got {ci}")
    return NormalDist().inv_cdf(0.5 + ci / 2)


def wilson_ci(successes: float, n: int, *, ci: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (``n = 0`` gives (0, 1))."""
    if n <= 0:
        return 0.0, 1.0
    z = _z(ci)
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo = 0.0 if successes <= 0 else max(0.0, centre - half)  # exact ends at 0/n and n/n
    hi = 1.0 if successes >= n else min(1.0, centre + half)
    return lo, hi


def _as_matrix(x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2:
        raise ValueError(f"outcomes must be (Q,) or (Q, R), got shape {a.shape}")
    if a.shape[0] == 0:
        raise ValueError("outcomes are empty (no questions)")
    if np.isnan(a).all(axis=1).any():
        raise ValueError("every question needs at least one non-NaN outcome")
    return a


def _per_question(a: np.ndarray) -> np.ndarray:
    return np.nanmean(a, axis=1)  # (Q,)


def _bootstrap_means(values: np.ndarray, n_boot: int, seed: int, chunk: int = 2000) -> np.ndarray:
    """(n_boot,) means of ``values`` (Q,) over question resamples with replacement."""
    rng = np.random.default_rng(seed)
    q = values.shape[0]
    out = np.empty(n_boot)
    for a in range(0, n_boot, chunk):
        b = min(n_boot, a + chunk)
        idx = rng.integers(0, q, size=(b - a, q))  # (chunk, Q)
        out[a:b] = values[idx].mean(axis=1)
    return out


@dataclass(frozen=True)
class AccuracyCI:
    accuracy: float
    lo: float
    hi: float
    n_questions: int
    n_samples: int
    method: str


def accuracy_ci(outcomes, *, ci: float = 0.95, method: Literal["auto", "wilson", "bootstrap"] = "auto",
                n_boot: int = 10000, seed: int = 0) -> AccuracyCI:  # fmt: skip
    """Accuracy (mean of per-question means) with a ``ci`` interval.

    ``auto``: Wilson with one sample per question, else a question bootstrap
    (percentile). Wilson on several samples per question would treat them as
    independent and be too narrow, so it is refused.
    """
    a = _as_matrix(outcomes)
    per_q = _per_question(a)
    n_samples = int((~np.isnan(a)).sum())
    one = a.shape[1] == 1
    if method == "auto":
        method = "wilson" if one else "bootstrap"
    acc = float(per_q.mean())
    if method == "wilson":
        if not one:
            raise ValueError("wilson needs one sample per question; use method='bootstrap'")
        lo, hi = wilson_ci(float(per_q.sum()), len(per_q), ci=ci)
    elif method == "bootstrap":
        boot = _bootstrap_means(per_q, n_boot, seed)
        lo, hi = np.quantile(boot, [(1 - ci) / 2, (1 + ci) / 2])
    else:
        raise ValueError(f"method must be auto, wilson or bootstrap, got {method!r}")
    return AccuracyCI(acc, float(lo), float(hi), len(per_q), n_samples, method)


@dataclass(frozen=True)
class PairedComparison:
    """``A - B`` on the same questions."""

    acc_a: float
    acc_b: float
    diff: float
    """``acc_a - acc_b`` (means of per-question means)."""
    lo: float
    hi: float
    p_value: float
    """Exact two-sided sign test of the per-question differences (:func:`sign_test`; ties dropped)."""
    n_questions: int
    n_boot: int
    ci: float
    wins: int
    """Questions where A's per-question mean is higher."""
    losses: int
    ties: int


def paired_bootstrap(a, b, *, ci: float = 0.95, n_boot: int = 10000, seed: int = 0) -> PairedComparison:
    """Paired bootstrap CI of the accuracy difference between two runs on the same questions.

    Args:
        a, b: ``(Q,)`` or ``(Q, R)`` outcomes, row q of both = the same question
            (R may differ between a and b; NaN marks a missing sample).
    """
    A, B = _as_matrix(a), _as_matrix(b)
    if A.shape[0] != B.shape[0]:
        raise ValueError(f"paired outcomes need the same questions: {A.shape[0]} vs {B.shape[0]} rows")
    qa, qb = _per_question(A), _per_question(B)
    d = qa - qb  # (Q,) per-question difference; resampling d keeps pairs together
    boot = _bootstrap_means(d, n_boot, seed)
    lo, hi = np.quantile(boot, [(1 - ci) / 2, (1 + ci) / 2])
    return PairedComparison(acc_a=float(qa.mean()), acc_b=float(qb.mean()), diff=float(d.mean()), lo=float(lo),
                            hi=float(hi), p_value=sign_test(d), n_questions=len(d), n_boot=n_boot, ci=ci,
                            wins=int((d > 0).sum()), losses=int((d < 0).sum()), ties=int((d == 0).sum()))  # fmt: skip


def _num(v, where: str) -> float:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    raise ValueError(f"{where}: outcome must be a boolean or a finite number, got {v!r}")


def load_outcomes(path: str | Path) -> dict[str, list[float]]:
    """Per-question outcome lists from a JSONL (one record per sample) or JSON-object file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{p}: not UTF-8 text (byte {exc.start}); expected a JSONL or JSON file of outcomes") from None
    except OSError as exc:
        raise ValueError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    out: dict[str, list[float]] = {}
    stripped = text.lstrip()
    if stripped.startswith("{") and "\n{" not in stripped.strip():
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and not any(k in obj for k in ID_KEYS):
            for q, v in obj.items():
                vals = v if isinstance(v, list) else [v]
                out[str(q)] = [_num(x, f"{p} question {q!r}") for x in vals]
            if not out:
                raise ValueError(f"{p}: no outcomes")
            return out
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        qid = next((rec[k] for k in ID_KEYS if k in rec), None)
        key = next((k for k in VALUE_KEYS if k in rec), None)
        if qid is None or key is None:
            raise ValueError(f"{where}: a record needs an id ({'/'.join(ID_KEYS)}) and an outcome ({'/'.join(VALUE_KEYS)})")
        out.setdefault(str(qid), []).append(_num(rec[key], where))
    if not out:
        raise ValueError(f"{p}: no outcomes")
    return out


def align_outcomes(a: dict[str, list[float]], b: dict[str, list[float]], *,
                   on_mismatch: Literal["error", "intersect"] = "error") -> tuple[list[str], np.ndarray, np.ndarray]:  # fmt: skip
    """Common question ids (sorted) and the two NaN-padded ``(Q, R)`` matrices."""
    ka, kb = set(a), set(b)
    if ka != kb:
        only_a, only_b = sorted(ka - kb), sorted(kb - ka)
        msg = (f"the two outcome sets cover different questions: {len(only_a)} only in A (e.g. {only_a[:3]}), "
               f"{len(only_b)} only in B (e.g. {only_b[:3]})")  # fmt: skip
        if on_mismatch == "error":
            raise ValueError(msg + "; pass on_mismatch='intersect' to compare the common ones")
    ids = sorted(ka & kb)
    if not ids:
        raise ValueError("no question in common")

    def mat(d):
        r = max(len(d[q]) for q in ids)
        m = np.full((len(ids), r), np.nan)
        for i, q in enumerate(ids):
            m[i, : len(d[q])] = d[q]
        return m

    return ids, mat(a), mat(b)


def compare_outcome_files(path_a, path_b, *, ci: float = 0.95, n_boot: int = 10000, seed: int = 0,
                          on_mismatch: Literal["error", "intersect"] = "error") -> PairedComparison:  # fmt: skip
    """:func:`paired_bootstrap` of two outcome files, aligned by question id."""
    _, A, B = align_outcomes(load_outcomes(path_a), load_outcomes(path_b), on_mismatch=on_mismatch)
    return paired_bootstrap(A, B, ci=ci, n_boot=n_boot, seed=seed)


def format_comparison(c: PairedComparison, name_a: str = "A", name_b: str = "B") -> str:
    pct = lambda x: f"{100 * x:.2f}"  # noqa: E731
    return "\n".join([
        f"questions: {c.n_questions}   bootstrap resamples: {c.n_boot}",
        f"accuracy {name_a}: {pct(c.acc_a)} %   {name_b}: {pct(c.acc_b)} %",
        f"difference ({name_a} - {name_b}): {pct(c.diff)} points, {int(100 * c.ci)}% CI "
        f"[{pct(c.lo)}, {pct(c.hi)}], exact sign test p = {c.p_value:.4f}",
        f"per question: {name_a} better {c.wins}, {name_b} better {c.losses}, tied {c.ties}",
    ])  # fmt: skip


# ----------------------------------------------------------------------------- exact tests, seeds, power


def sign_test(d) -> float:
    """Exact two-sided sign test of per-question differences ``d`` (ties dropped): the binomial test of
    ``wins`` out of ``wins + losses`` at 1/2 (``scipy.stats.binomtest(w, n, 0.5).pvalue``). On 0/1
    outcomes with one sample per question this is McNemar's exact test."""
    d = np.asarray(d, dtype=np.float64)
    w, n = int((d > 0).sum()), int((d != 0).sum())
    if n == 0:
        return 1.0
    k = min(w, n - w)
    log_pmf = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2) for i in range(k + 1)]
    return min(1.0, 2.0 * float(np.exp(log_pmf).sum())) if 2 * k != n else 1.0


def sign_flip_test(d, *, n_perm: int = 200_000, seed: int = 0, exact_max: int = 20) -> float:
    """Two-sided sign-flip permutation test of ``mean(d) = 0`` (d: per-question paired differences).

    Exact (all ``2^m`` flips of the ``m`` non-zero differences) when ``m <= exact_max``, otherwise
    ``n_perm`` random flips with the ``(1 + hits) / (1 + n_perm)`` correction."""
    d = np.asarray(d, dtype=np.float64)
    d = d[d != 0]
    m = len(d)
    if m == 0:
        return 1.0
    obs = abs(d.sum())
    tol = 1e-12 * max(1.0, obs)
    if m <= exact_max:
        signs = ((np.arange(2**m)[:, None] >> np.arange(m)) & 1) * 2 - 1
        return float((np.abs(signs @ d) >= obs - tol).mean())
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, n_perm, 20_000):
        s = rng.integers(0, 2, size=(min(20_000, n_perm - start), m)) * 2 - 1
        hits += int((np.abs(s @ d) >= obs - tol).sum())
    return (1 + hits) / (1 + n_perm)


def seed_permutation_test(a, b, *, max_exact: int = 200_000, n_perm: int = 100_000, seed: int = 0) -> float:
    """Two-sided permutation test that per-seed accuracies ``a`` and ``b`` come from one distribution,
    statistic ``|mean(a) - mean(b)|``: exact over every split of the pooled runs into groups of S_a and S_b
    when there are at most ``max_exact`` (``scipy.stats.permutation_test``, ``independent``, all splits),
    else ``n_perm`` random splits with ``(1 + hits) / (1 + n_perm)``."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    pooled = np.concatenate([a, b])
    n, k = len(pooled), len(a)
    if k == 0 or k == n:
        raise ValueError("both arms need at least one seed")
    obs = abs(a.mean() - b.mean())
    tol = 1e-12 + 1e-9 * obs
    total = pooled.sum()
    if math.comb(n, k) <= max_exact:
        idx = np.array(list(combinations(range(n), k)))
        sa = pooled[idx].sum(1)
        return float((np.abs(sa / k - (total - sa) / (n - k)) >= obs - tol).mean())
    rng, hits = np.random.default_rng(seed), 0
    for start in range(0, n_perm, 10_000):
        perm = rng.permuted(np.tile(pooled, (min(10_000, n_perm - start), 1)), axis=1)
        sa = perm[:, :k].sum(1)
        hits += int((np.abs(sa / k - (total - sa) / (n - k)) >= obs - tol).sum())
    return (1 + hits) / (1 + n_perm)


def holm(p_values) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error), in the input order."""
    p = np.asarray(p_values, dtype=np.float64)
    m = len(p)
    order = np.argsort(p, kind="stable")
    adj = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adj[i] = running
    return adj.tolist()


@dataclass(frozen=True)
class SeedCI:
    """Accuracy over training seeds and questions."""

    accuracy: float
    lo: float
    hi: float
    seeds: int
    questions: int
    per_seed: tuple[float, ...]


def _two_stage(x: np.ndarray, n_boot: int, rng) -> np.ndarray:
    """Bootstrap means of an (S, Q) matrix: resample seeds, and questions (the same draw for every seed)."""
    s, q = x.shape
    out = np.empty(n_boot)
    for i in range(n_boot):
        rs, rq = rng.integers(0, s, s), rng.integers(0, q, q)
        out[i] = x[np.ix_(rs, rq)].mean()
    return out


def seed_question_ci(x, *, ci: float = 0.95, n_boot: int = 4000, seed: int = 0) -> SeedCI:
    """Mean accuracy of an (S seeds, Q questions) matrix of per-question means, with a percentile
    interval from a two-stage bootstrap over seeds and questions."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"need an (S, Q) matrix of per-question means, got shape {x.shape}")
    boot = _two_stage(x, n_boot, np.random.default_rng(seed))
    lo, hi = np.quantile(boot, [(1 - ci) / 2, (1 + ci) / 2])
    return SeedCI(float(x.mean()), float(lo), float(hi), x.shape[0], x.shape[1], tuple(x.mean(1).tolist()))


@dataclass(frozen=True)
class ArmComparison:
    """Arm A − arm B on the same questions, over training seeds."""

    diff: float
    lo: float
    hi: float
    p_sign: float
    """Exact sign test on per-question differences (seed-averaged): questions are the unit."""
    p_seeds: float
    """Exact permutation test on per-seed accuracies: training runs are the unit."""
    wins: int
    losses: int
    ties: int
    seeds_a: int
    seeds_b: int
    questions: int


def compare_arms(a, b, *, ci: float = 0.95, n_boot: int = 4000, seed: int = 0) -> ArmComparison:
    """Paired (same questions) comparison of two arms given (S_a, Q) and (S_b, Q) per-question means.

    The interval resamples questions (the same draw for both arms, so question difficulty cancels) and
    each arm's seeds independently (different training runs)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"arms must be evaluated on the same questions: {a.shape[1]} vs {b.shape[1]}")
    rng = np.random.default_rng(seed)
    q = a.shape[1]
    boot = np.empty(n_boot)
    for i in range(n_boot):
        rq = rng.integers(0, q, q)
        ra, rb = rng.integers(0, a.shape[0], a.shape[0]), rng.integers(0, b.shape[0], b.shape[0])
        boot[i] = a[np.ix_(ra, rq)].mean() - b[np.ix_(rb, rq)].mean()
    lo, hi = np.quantile(boot, [(1 - ci) / 2, (1 + ci) / 2])
    d = a.mean(0) - b.mean(0)
    return ArmComparison(float(d.mean()), float(lo), float(hi), sign_test(d), seed_permutation_test(a.mean(1), b.mean(1)),
                         int((d > 0).sum()), int((d < 0).sum()), int((d == 0).sum()), a.shape[0], b.shape[0], q)


@dataclass(frozen=True)
class Power:
    """Smallest difference detectable at ``power`` (two-sided ``alpha``) and what it is made of."""

    mde: float
    seed_var: float
    """Variance of one run's accuracy across training seeds (pooled over arms)."""
    question_var: float
    """Variance across questions of the seed-averaged per-question difference."""
    seeds: int
    questions: int
    table: dict[str, float]
    """MDE for other grid sizes: ``"S seeds x Q questions"`` → difference."""


def detectable_difference(arms: list[np.ndarray], *, alpha: float = 0.05, power: float = 0.8,
                          seeds_options=(5, 10, 20, 40), question_factors=(1, 3, 9)) -> Power:  # fmt: skip
    """MDE of a two-arm difference from the measured variances of (S, Q) per-question-mean matrices.

    ``SE² = 2 v_seed / S + v_q / Q`` — the seed term from the spread of per-run accuracies (on the same
    questions), the question term from the spread of per-question differences between arms; MDE =
    ``(z_{1-alpha/2} + z_power) * SE`` (normal approximation)."""
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    seed_vars = [float(np.var(x.mean(1), ddof=1)) for x in arms if x.shape[0] > 1]
    v_seed = float(np.mean(seed_vars)) if seed_vars else 0.0
    diffs = [arms[i].mean(0) - arms[j].mean(0) for i in range(len(arms)) for j in range(i + 1, len(arms))]
    v_q = float(np.mean([np.var(d, ddof=1) for d in diffs])) if diffs else 0.0
    s, q = max(x.shape[0] for x in arms), arms[0].shape[1]  # the grid as it will be: its most-seeded arm

    def mde(n_s: int, n_q: int) -> float:
        return z * math.sqrt(2 * v_seed / n_s + v_q / n_q)

    table = {f"{n_s} seeds x {f * q} questions": mde(n_s, f * q) for n_s in seeds_options for f in question_factors}
    return Power(mde(s, q), v_seed, v_q, s, q, table)
