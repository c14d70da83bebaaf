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
    assert (top.diff, top.lo, top.hi, top.p_value, top.wins) == (1.0, 1.0, 1.0, 0.0, 30)


def test_paired_matches_normal_approximation():
    # A is right on 200 of 400 questions where B is wrong, tied elsewhere: d in {0, 1}, mean 0.5, sd 0.5.
    q = 400
    b = np.zeros(q)
    a = np.r_[np.ones(200), np.zeros(200)]
    c = paired_bootstrap(a, b, n_boot=20000, seed=3)
    se = np.std(a - b, ddof=0) / math.sqrt(q)  # 0.025
    assert c.diff == 0.5
    assert c.lo == pytest.approx(0.5 - 1.96 * se, abs=0.006) and c.hi == pytest.approx(0.5 + 1.96 * se, abs=0.006)
    assert c.p_value == 0.0
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
