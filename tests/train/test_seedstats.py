"""Seed-level comparisons (``mosaic.train.seedstats``) against scipy on fixed inputs, and on simulated
seeds x questions with a known seed effect: a planted difference is found, a planted null is not."""

import json
from itertools import combinations

import numpy as np
import pytest

from mosaic.train import seedstats as ss

scipy_stats = pytest.importorskip("scipy.stats")


def _abs_mean_diff(x, y, axis=-1):
    return np.abs(np.mean(x, axis=axis) - np.mean(y, axis=axis))


def _scipy_perm(a, b, **kw) -> float:
    """The two-sided test as |mean(a) - mean(b)| >= observed (scipy's own "two-sided" doubles the smaller
    tail instead, which differs when the arms differ in size)."""
    kw = {"n_resamples": np.inf, **kw}
    return scipy_stats.permutation_test((a, b), _abs_mean_diff, permutation_type="independent", vectorized=True,
                                        alternative="greater", **kw).pvalue


def test_student_t_and_incomplete_beta_match_scipy():
    from scipy import special

    rng = np.random.default_rng(0)
    a, b, x = rng.uniform(0.1, 600, 300), rng.uniform(0.1, 600, 300), rng.uniform(0, 1, 300)
    assert ss.betainc(a, b, x) == pytest.approx(special.betainc(a, b, x), abs=1e-12)
    for df in (1, 2.5, 8, 30, 500):
        for t in (-6, -1.3, 0, 0.7, 3):
            assert float(ss.t_cdf(t, df)) == pytest.approx(scipy_stats.t.cdf(t, df), abs=1e-12)
        assert ss.t_ppf(0.975, df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-9)


def test_welch_and_seed_permutation_match_scipy():
    a, b = np.array([0.31, 0.28, 0.35, 0.30, 0.33]), np.array([0.27, 0.29, 0.25, 0.30, 0.26, 0.24])
    assert ss.welch_test(a, b) == pytest.approx(scipy_stats.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-10)
    assert ss.seed_permutation_test(a, b) == pytest.approx(_scipy_perm(a, b), rel=1e-12)
    assert ss.seed_permutation_test(a, b[:5]) == pytest.approx(_scipy_perm(a, b[:5]), rel=1e-12)
    assert ss.seed_permutation_test(np.ones(5), np.zeros(5)) == pytest.approx(2 / 252) == ss.min_permutation_p(5, 5)
    assert np.isnan(ss.welch_test(a, b[:1]))
    big_a, big_b = np.random.default_rng(1).normal(0.31, 0.02, 12), np.random.default_rng(2).normal(0.30, 0.02, 12)
    ref = _scipy_perm(big_a, big_b, n_resamples=100_000, random_state=0)  # C(24, 12) > max_exact: random splits
    assert ss.seed_permutation_test(big_a, big_b) == pytest.approx(ref, abs=0.01)


@pytest.mark.parametrize("n_seeds", [4, 5, 6])
def test_aa_calibration_matches_scipy_split_by_split(n_seeds):
    rng = np.random.default_rng(n_seeds)
    difficulty = rng.uniform(0, 1, 60)
    x = np.stack([(rng.uniform(0, 1, (60, 2)) < np.clip(difficulty[:, None] + rng.normal(0, 0.08), 0, 1)).mean(1)
                  for _ in range(n_seeds)])
    aa = ss.aa_calibration(x, alpha=0.2, interval_splits=0)  # alpha 0.2: small halves can reach it
    m1, m2 = ss.half_splits(n_seeds)
    k = n_seeds // 2
    expected = sum(1 for c in combinations(range(n_seeds - n_seeds % 2), k) if c[0] == 0) * (n_seeds if n_seeds % 2 else 1)
    assert aa.splits == len(m1) == expected and aa.halves == (k, k) and not (m1 & m2).any()
    perm, welch, sign = [], [], []
    for a, b in zip(m1, m2):
        pa, pb = x[a].mean(1), x[b].mean(1)
        perm.append(_scipy_perm(pa, pb))
        welch.append(scipy_stats.ttest_ind(pa, pb, equal_var=False).pvalue)
        d = x[a].mean(0) - x[b].mean(0)
        w, n = int((d > 0).sum()), int((d != 0).sum())
        sign.append(scipy_stats.binomtest(w, n, 0.5).pvalue if n else 1.0)
    assert aa.rate_seeds == pytest.approx(np.mean(np.array(perm) < 0.2))
    assert aa.rate_welch == pytest.approx(np.mean(np.array(welch) < 0.2))
    assert aa.rate_sign == pytest.approx(np.mean(np.array(sign) < 0.2))
    with pytest.raises(ValueError, match="at least 4 seeds"):
        ss.aa_calibration(x[:3])


def test_power_matches_the_noncentral_t_and_the_seed_count_reaches_it():
    for na, nb, sd in ((5, 5, 0.02), (10, 10, 0.03), (15, 15, 0.025), (8, 12, 0.03)):
        df, ncp = na + nb - 2, 0.035 / (sd * np.sqrt(1 / na + 1 / nb))
        tc = scipy_stats.t.ppf(0.975, df)
        exact = 1 - scipy_stats.nct.cdf(tc, df, ncp) + scipy_stats.nct.cdf(-tc, df, ncp)
        assert ss.seed_power(sd, na, nb) == pytest.approx(exact, abs=0.015)
    assert ss.seed_power(0.02, 3, 3) == 0.0  # the exact test's smallest p at 3 + 3 is 0.1
    n = ss.seeds_for_power(0.022)
    assert ss.seed_power(0.022, n, n) >= 0.8 > ss.seed_power(0.022, n - 1, n - 1)
    assert ss.seeds_for_power(0.044) > n


def _simulate(rng, seeds: int, effect: float, seed_sd: float = 0.03, q: int = 120) -> tuple[np.ndarray, np.ndarray]:
    """Two arms' (seeds, q) per-question means (2 samples each): question difficulty shared by every run,
    each run's own offset (the seed effect, sd ``seed_sd``), arm B shifted by ``effect``."""
    difficulty = rng.uniform(0.05, 0.6, q)

    def arm(shift):
        p = np.clip(difficulty[None, :] + shift + rng.normal(0, seed_sd, (seeds, 1)), 0, 1)
        return (rng.uniform(0, 1, (seeds, q, 2)) < p[:, :, None]).mean(2)

    return arm(0.0), arm(effect)


def test_a_planted_difference_is_found():
    rng = np.random.default_rng(7)
    a, b = _simulate(rng, 8, 0.10)
    c = ss.compare_seeds(b, a, n_boot=1000)
    assert c.p_seeds < 0.01 and c.p_welch < 0.01 and c.lo > 0 and c.diff > 0.05
    assert c.seeds_a == c.seeds_b == 8 and c.questions == 120
    assert c.power == pytest.approx(ss.seed_power(c.sd, 8, 8)) and c.seeds_needed == ss.seeds_for_power(c.sd)


def test_a_planted_null_is_not_found_by_the_seed_tests_but_is_by_the_question_test():
    """Over 300 simulated null grids (6 + 6 seeds, a real seed effect), the seed tests reject near 5 %; the
    question-level sign test, which treats the 120 questions as independent, rejects well above 5 %."""
    rng = np.random.default_rng(11)
    rej = {"seeds": 0, "welch": 0, "sign": 0}
    n = 300
    for _ in range(n):
        a, b = _simulate(rng, 6, 0.0)
        rej["seeds"] += ss.seed_permutation_test(a.mean(1), b.mean(1)) < 0.05
        rej["welch"] += ss.welch_test(a.mean(1), b.mean(1)) < 0.05
        from mosaic.train.stats import sign_test

        rej["sign"] += sign_test(a.mean(0) - b.mean(0)) < 0.05
    rate = {k: v / n for k, v in rej.items()}
    assert 0.02 <= rate["seeds"] <= 0.09 and 0.01 <= rate["welch"] <= 0.09, rate
    assert rate["sign"] > 0.1, rate


def test_the_interval_covers_a_planted_null():
    rng = np.random.default_rng(5)
    excl = [not (lo <= 0 <= hi) for lo, hi in
            (ss.hierarchical_bootstrap(*_simulate(rng, 6, 0.0), n_boot=400, seed=i) for i in range(60))]
    assert np.mean(excl) <= 0.12


def test_compare_says_which_unit_it_tests(tmp_path, capsys):
    from mosaic.cli import main

    rng = np.random.default_rng(3)
    a, b = _simulate(rng, 4, 0.08, q=40)
    files = {}
    for name, x in (("a", a), ("b", b)):
        files[name] = []
        for s, row in enumerate(x):
            p = tmp_path / f"{name}{s}.jsonl"
            p.write_text("".join(json.dumps({"question_id": f"q{i}", "correct": bool(v >= 0.5)}) + "\n"
                                 for i, v in enumerate(row)))
            files[name].append(str(p))
    assert main(["compare", ",".join(files["b"]), ",".join(files["a"]), "--n-boot", "500"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("unit: training seeds (4 runs of A, 4 of B)") and "exact permutation test over seeds" in out
    assert "conditional on these trained models" in out and "A/A A (4 seeds, 3 splits into 2 v 2)" in out
    assert main(["compare", ",".join(files["b"]), ",".join(files["a"]), "--n-boot", "200", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["unit"] == "seeds" and res["seeds_a"] == 4 and set(res["aa"]) == {"A", "B"}
    assert main(["compare", files["a"][0], files["b"][0], "--n-boot", "200"]) == 0
    assert capsys.readouterr().out.startswith("unit: questions, conditional on the two trained models")
    assert main(["compare", ",".join(files["a"]), files["b"][0]]) == 2
    assert "one per training seed" in capsys.readouterr().err
