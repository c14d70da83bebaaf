import json
import math

import numpy as np
import pytest

from mosaic.train.stats import (
    accuracy_ci,
    align_outcomes,
    compare_outcome_files,
    format_comparison,
    load_outcomes,
    paired_bootstrap,
    wilson_ci,
)


def test_wilson_hand_values():
    lo, hi = wilson_ci(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    assert wilson_ci(0, 20)[0] == 0.0 and wilson_ci(20, 20)[1] == 1.0
    lo, hi = wilson_ci(50, 100)
    assert lo == pytest.approx(1 - hi) and hi == pytest.approx(0.5 + 0.0962, abs=1e-4)


def test_accuracy_ci_modes():
    one = np.array([1, 1, 0, 1, 0, 1, 1, 1, 0, 1], dtype=float)
    r = accuracy_ci(one)
    assert r.method == "wilson" and r.accuracy == 0.7 and (r.lo, r.hi) == wilson_ci(7, 10)
    multi = np.array([[1, 0], [1, 1], [0, 0], [1, np.nan]])  # per-question means 0.5, 1, 0, 1
    r = accuracy_ci(multi, seed=1)
    assert r.method == "bootstrap" and r.accuracy == pytest.approx(0.625) and r.n_samples == 7
    assert 0 <= r.lo <= r.accuracy <= r.hi <= 1
    with pytest.raises(ValueError, match="one sample per question"):
        accuracy_ci(multi, method="wilson")


def test_paired_identical_and_dominating():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, size=(50, 3)).astype(float)
    same = paired_bootstrap(a, a)
    assert same.diff == 0 and same.lo == 0 and same.hi == 0 and same.p_value == 1.0 and same.ties == 50
    top = paired_bootstrap(np.ones(30), np.zeros(30))
    assert (top.diff, top.lo, top.hi, top.wins) == (1.0, 1.0, 1.0, 30)
    assert top.p_value == pytest.approx(2 * 0.5**30, rel=1e-9)  # exact sign test: 30 wins, 0 losses


def test_paired_matches_normal_approximation():
    # A is right on 200 of 400 questions where B is wrong, tied elsewhere: d in {0, 1}, mean 0.5, sd 0.5.
    q = 400
    b = np.zeros(q)
    a = np.r_[np.ones(200), np.zeros(200)]
    c = paired_bootstrap(a, b, n_boot=20000, seed=3)
    se = np.std(a - b, ddof=0) / math.sqrt(q)  # 0.025
    assert c.diff == 0.5
    assert c.lo == pytest.approx(0.5 - 1.96 * se, abs=0.006) and c.hi == pytest.approx(0.5 + 1.96 * se, abs=0.006)
    assert c.p_value == pytest.approx(2 * 0.5**200, rel=1e-6)  # 200 wins, 0 losses, 200 ties
    assert paired_bootstrap(a, b, n_boot=20000, seed=3) == c  # seeded


def test_pairing_is_tighter_than_independent_intervals():
    rng = np.random.default_rng(1)
    difficulty = rng.random(300)
    b = (rng.random(300) > difficulty).astype(float)
    a = np.where(rng.random(300) < 0.1, 1.0, b)  # A = B plus a few extra solved questions
    c = paired_bootstrap(a, b, seed=0)
    wa, wb = accuracy_ci(a), accuracy_ci(b)
    assert c.lo > 0  # the paired test sees the gain
    assert wa.lo < wb.hi  # independent intervals overlap
    assert (c.hi - c.lo) < 0.5 * ((wa.hi - wa.lo) + (wb.hi - wb.lo)) / 2


def test_outcome_files(tmp_path):
    pa, pb = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    pa.write_text("\n".join(json.dumps({"question_id": q, "correct": c}) for q, c in
                            [("q1", True), ("q1", False), ("q2", True), ("q3", False)]))
    pb.write_text(json.dumps({"q1": [0, 0], "q2": 0, "q3": 0}))
    assert load_outcomes(pa) == {"q1": [1.0, 0.0], "q2": [1.0], "q3": [0.0]}
    c = compare_outcome_files(pa, pb, n_boot=2000)
    assert c.n_questions == 3 and c.diff == pytest.approx(0.5)  # (0.5 + 1 + 0) / 3
    assert "difference (A - B): 50.00 points" in format_comparison(c)
    pc = tmp_path / "c.jsonl"
    pc.write_text(json.dumps({"task_id": "q1", "reward": 1}) + "\n" + json.dumps({"task_id": "q9", "reward": 0}))
    with pytest.raises(ValueError, match="different questions"):
        compare_outcome_files(pa, pc)
    ids, A, C = align_outcomes(load_outcomes(pa), load_outcomes(pc), on_mismatch="intersect")
    assert ids == ["q1"] and A.shape == (1, 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": "q1"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_outcomes(bad)


from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1)), min_size=1, max_size=60), st.integers(0, 10))
def test_paired_properties(pairs, seed):
    a = np.array([p[0] for p in pairs], dtype=float)
    b = np.array([p[1] for p in pairs], dtype=float)
    ab = paired_bootstrap(a, b, n_boot=300, seed=seed)
    ba = paired_bootstrap(b, a, n_boot=300, seed=seed)
    assert ab.diff == pytest.approx(-ba.diff)
    assert ab.lo == pytest.approx(-ba.hi) and ab.hi == pytest.approx(-ba.lo)  # same resamples, mirrored
    assert -1 <= ab.lo <= ab.hi <= 1 and 0 <= ab.p_value <= 1
    assert ab.wins + ab.losses + ab.ties == len(pairs)
    r = accuracy_ci(a)
    assert 0 <= r.lo <= r.accuracy <= r.hi <= 1


# --- exact tests and seed-level statistics, checked against scipy.stats on fixed inputs


def test_sign_test_matches_scipy_binomtest():
    from scipy.stats import binomtest

    from mosaic.train.stats import sign_test

    # the main job's 32 wins / 19 losses / 77 ties: bootstrap p was 0.037, the exact test says 0.092
    d = np.r_[np.full(32, 0.25), np.full(19, -0.5), np.zeros(77)]
    assert sign_test(d) == pytest.approx(binomtest(32, 51, 0.5).pvalue, rel=1e-10)
    assert sign_test(d) == pytest.approx(0.0924, abs=5e-4)
    for w, l in [(0, 0), (3, 3), (10, 0), (0, 7), (60, 41), (5, 6), (250, 200)]:
        d = np.r_[np.ones(w), -np.ones(l), np.zeros(4)]
        want = binomtest(w, w + l, 0.5).pvalue if w + l else 1.0
        assert sign_test(d) == pytest.approx(want, rel=1e-9, abs=1e-300), (w, l)


def test_paired_bootstrap_p_is_the_exact_sign_test():
    from scipy.stats import binomtest

    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 2, (128, 4)).astype(float), rng.integers(0, 2, (128, 4)).astype(float)
    c = paired_bootstrap(a, b)
    assert c.p_value == pytest.approx(binomtest(c.wins, c.wins + c.losses, 0.5).pvalue, rel=1e-10)


def test_sign_flip_test_matches_scipy_permutation_test():
    from scipy.stats import permutation_test

    from mosaic.train.stats import sign_flip_test

    d = np.array([0.25, -0.5, 0.75, 0.25, 0.5, -0.25, 0.5, 0.0, 1.0, 0.25, -0.75, 0.5])
    nz = d[d != 0]
    ref = permutation_test((nz,), np.mean, permutation_type="samples", alternative="two-sided",
                           n_resamples=np.inf).pvalue
    assert sign_flip_test(d) == pytest.approx(ref, rel=1e-12)
    big = np.random.default_rng(1).normal(0.1, 1.0, 60)
    ref = permutation_test((big,), np.mean, permutation_type="samples", n_resamples=200_000, random_state=0).pvalue
    assert sign_flip_test(big, n_perm=200_000) == pytest.approx(ref, abs=0.01)


def test_seed_permutation_test_matches_scipy():
    from scipy.stats import permutation_test

    from mosaic.train.stats import seed_permutation_test

    a, b = np.array([0.31, 0.28, 0.35, 0.30, 0.33]), np.array([0.27, 0.29, 0.25, 0.30, 0.26])
    ref = permutation_test((a, b), lambda x, y: np.mean(x) - np.mean(y), permutation_type="independent",
                           n_resamples=np.inf).pvalue
    assert seed_permutation_test(a, b) == pytest.approx(ref, rel=1e-12)
    assert seed_permutation_test(np.ones(5), np.zeros(5)) == pytest.approx(2 / 252)


def test_holm_adjustment():
    from mosaic.train.stats import holm

    # hand-computed: sorted 0.01, 0.02, 0.03, 0.04 → 4*0.01, max(., 3*0.02), max(., 2*0.03), max(., 0.04)
    assert holm([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])  # 2 * 0.8 capped at 1, then monotone


def test_seed_question_interval_and_arm_comparison():
    from mosaic.train.stats import compare_arms, detectable_difference, seed_question_ci

    rng = np.random.default_rng(2)
    q = 200
    difficulty = rng.uniform(0, 1, q)
    a = np.stack([(rng.uniform(0, 1, q) < difficulty * 0.9 + 0.05).astype(float) for _ in range(5)])
    b = np.stack([(rng.uniform(0, 1, q) < difficulty * 0.9).astype(float) for _ in range(5)])
    ci = seed_question_ci(a)
    assert ci.lo < ci.accuracy < ci.hi and ci.seeds == 5 and ci.questions == q
    assert ci.accuracy == pytest.approx(a.mean())
    c = compare_arms(a, b)
    assert c.diff == pytest.approx(a.mean() - b.mean()) and c.lo < c.diff < c.hi
    assert 0 < c.p_seeds <= 1 and 0 <= c.p_sign <= 1
    same = compare_arms(a, a)
    assert same.diff == 0 and same.p_sign == 1.0 and same.p_seeds == 1.0
    pw = detectable_difference([a, b])
    assert pw.mde > 0 and pw.table["40 seeds x 1800 questions"] < pw.table["5 seeds x 200 questions"] == pytest.approx(pw.mde)
    with pytest.raises(ValueError, match="same questions"):
        compare_arms(a, b[:, :10])
