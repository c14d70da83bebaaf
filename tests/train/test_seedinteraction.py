"""The interaction of arm and setting (``mosaic.train.seedinteraction``): the Welch-type contrast against a
direct computation with scipy's t distribution, a planted interaction found, a planted additive world (arm
and setting effects, no interaction) not, and the A/A check near its nominal rate."""

import numpy as np
import pytest

from mosaic.train.seedinteraction import aa_interaction, interaction

scipy_stats = pytest.importorskip("scipy.stats")


def _world(rng, mu: float, seeds: int, questions: int, qdiff: np.ndarray, seed_sd: float = 0.03) -> np.ndarray:
    """(seeds, questions) outcomes: each seed a run whose accuracy is ``mu`` plus a run effect, each question
    its own difficulty (shared by every cell: the crossed design of a grid)."""
    run = rng.normal(0, seed_sd, size=(seeds, 1))
    p = np.clip(mu + run + qdiff[None, :], 0, 1)
    return (rng.random((seeds, questions)) < p).astype(float)


def test_the_contrast_test_matches_a_direct_welch_satterthwaite_computation():
    rng = np.random.default_rng(3)
    cells = [rng.random((n, 40)) for n in (5, 7, 6, 8)]
    got = interaction(*cells, n_boot=200)
    m = [c.mean(1) for c in cells]
    v = [x.var(ddof=1) / len(x) for x in m]
    est = m[0].mean() - m[1].mean() - m[2].mean() + m[3].mean()
    se = np.sqrt(sum(v))
    df = sum(v) ** 2 / sum(vi**2 / (len(x) - 1) for vi, x in zip(v, m))
    assert got.diff == pytest.approx(est, abs=1e-12)
    assert got.df == pytest.approx(df, rel=1e-9)
    assert got.p_welch == pytest.approx(2 * scipy_stats.t.sf(abs(est) / se, df), abs=1e-10)
    assert got.seeds == (5, 7, 6, 8) and got.questions == 40
    # with two cells empty of effect it is Welch's two-sample test of the other two
    z = [np.full((4, 40), 0.5), np.full((4, 40), 0.5)]
    two = interaction(cells[0], cells[1], *z, n_boot=200)
    assert two.p_welch == pytest.approx(scipy_stats.ttest_ind(m[0], m[1], equal_var=False).pvalue, abs=1e-10)


def test_a_planted_interaction_is_found_and_an_additive_world_is_not():
    rng = np.random.default_rng(0)
    q = rng.normal(0, 0.15, 384)
    # A leads B by 15 points under setting 1 and by 0 under setting 2: interaction +15 points (the contrast's
    # standard error here is ~2 points: seed SD ~3 points over four cells of 10)
    planted = interaction(_world(rng, 0.50, 10, 384, q), _world(rng, 0.35, 10, 384, q),
                          _world(rng, 0.30, 10, 384, q), _world(rng, 0.30, 10, 384, q))  # fmt: skip
    assert planted.p_welch < 0.01 and planted.lo > 0 and planted.diff == pytest.approx(0.15, abs=0.06)
    # A leads by 4 points in both settings, setting 1 is 15 points easier: no interaction
    hits, covered = 0, 0
    for _ in range(40):
        r = interaction(_world(rng, 0.49, 10, 384, q), _world(rng, 0.45, 10, 384, q),
                        _world(rng, 0.34, 10, 384, q), _world(rng, 0.30, 10, 384, q), n_boot=400)  # fmt: skip
        hits += r.p_welch < 0.05
        covered += r.lo <= 0 <= r.hi
    assert hits <= 6 and covered >= 34  # (nominal 2 of 40 false positives; 38 of 40 covered)


def test_aa_interaction_stays_near_its_nominal_rate_and_refuses_too_few_seeds():
    rng = np.random.default_rng(1)
    q = rng.normal(0, 0.15, 256)
    aa = aa_interaction(_world(rng, 0.40, 10, 256, q), _world(rng, 0.30, 10, 256, q), max_pairs=2000)
    assert aa["pairs"] == 2000 and aa["seeds"] == (10, 10)
    assert 0.0 <= aa["rate_welch"] <= 0.12
    with pytest.raises(ValueError, match="at least 4 seeds"):
        aa_interaction(np.ones((3, 5)), np.ones((6, 5)))
    with pytest.raises(ValueError, match="same questions"):
        interaction(np.ones((3, 5)), np.ones((3, 5)), np.ones((3, 4)), np.ones((3, 5)))
    with pytest.raises(ValueError, match="at least 2 seeds"):
        interaction(np.ones((1, 5)), np.ones((3, 5)), np.ones((3, 5)), np.ones((3, 5)))


def test_degenerate_cells_give_an_honest_p_or_a_clear_error():
    """Cells without spread: a contrast that is 0 up to the rounding of the means has p 1 (not 0); a real one p 0.
    A NaN or inf outcome is an error, not a p of 1; the A/A check refuses them too."""
    const = [np.full((4, 10), v) for v in (0.7, 0.6, 0.3, 0.2)]  # (0.7 - 0.6) - (0.3 - 0.2) = 0 up to rounding
    r = interaction(*const, n_boot=100)
    assert abs(r.diff) < 1e-12 and r.p_welch == 1.0
    assert interaction(np.full((4, 10), 0.9), *const[1:], n_boot=100).p_welch == 0.0
    bad = np.full((4, 10), 0.5)
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match="finite"):
        interaction(bad, *const[1:])
    with pytest.raises(ValueError, match="finite"):
        aa_interaction(np.where(np.isnan(bad), np.inf, bad), np.full((4, 10), 0.5))
    with pytest.raises(ValueError, match="same questions"):
        aa_interaction(np.ones((4, 10)), np.ones((4, 9)))


def test_the_power_is_the_shifted_t_approximation_and_falls_with_fewer_seeds():
    from mosaic.train.seedinteraction import contrast_power

    # 10 seeds per cell, seed SD 2.7 points: the contrast's SE is 1.7 points; ~half the time 3.5 points is found
    assert 0.4 < contrast_power(0.027, [10, 10, 10, 10], 0.035) < 0.65
    p = [contrast_power(0.027, [n] * 4, 0.035) for n in (2, 3, 5, 10, 20)]
    assert p == sorted(p) and p[0] < 0.12  # 2 seeds per cell: almost no power (df 4)
    assert np.isnan(contrast_power(0.0, [5] * 4))
