"""Advantage estimators: docs/algorithm.md §4.6 worked example, §4.5 properties, loop reference, registry."""

from __future__ import annotations

import math
import re

import numpy as np

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mosaic.core.advantages import (
    broadcast,
    centred_ranks,
    grpo,
    mosaic,
    normalized_session_gains,
    session_aware,
    turn_level,
    turn_level_gains,
)
from mosaic.core.estimators import ESTIMATORS, AdvantageBatch, get_estimator
from mosaic.trace import KIND_CODES

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- loop reference
# Deliberately naive: Python loops over groups / sessions, straight from docs/algorithm.md §4.


def ref_grpo(r, g, *, norm_by_std=True, eps=1e-6):
    out = [0.0] * len(r)
    for gid in set(g):
        idx = [i for i in range(len(r)) if g[i] == gid]
        if len(idx) < 2:
            continue
        vals = [r[i] for i in idx]
        mu = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
        for i in idx:
            out[i] = (r[i] - mu) / (sd + eps) if norm_by_std else r[i] - mu
    return out


def ref_centred(values):
    m = len(values)
    if m == 1:
        return [0.0]
    out = []
    for v in values:
        below = sum(1 for w in values if w < v)
        ties = sum(1 for w in values if w == v)
        avg_rank = below + (ties + 1) / 2  # average of ranks below+1 .. below+ties
        out.append(2 * (avg_rank - 1) / (m - 1) - 1)
    return out


def ref_session_aware(r, g, n, ok, *, rho=0.2, delta=0.1, norm_by_std=True, eps=1e-6):
    a = ref_grpo(r, g, norm_by_std=norm_by_std, eps=eps)
    out = [0.0] * len(r)
    for gid in set(g):
        idx = [i for i in range(len(r)) if g[i] == gid]
        n_ok = sum(bool(ok[i]) for i in idx)
        for flag in (True, False):
            sub = [i for i in idx if bool(ok[i]) == flag]
            if not sub:
                continue
            for i, u in zip(sub, ref_centred([n[i] for i in sub]), strict=True):
                if n_ok == len(idx):
                    out[i] = -delta * u
                elif n_ok == 0:
                    out[i] = delta * u
                else:
                    out[i] = a[i] * (1 - rho * u)
    return out


def ref_z(gains, kinds, fin, *, eps=1e-6):
    out = [0.0] * len(gains)
    for k in set(kinds):
        idx = [i for i in range(len(gains)) if kinds[i] == k and not fin[i]]
        if len(idx) < 2:
            continue
        vals = [gains[i] for i in idx]
        mu = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
        for i in idx:
            out[i] = (gains[i] - mu) / (sd + eps)
    return out


def ref_mosaic(r, g, n, ok, st_, gains, kinds, fin, *, rho=0.2, delta=0.1, lam=0.1, norm_by_std=True, eps=1e-6):
    a = ref_session_aware(r, g, n, ok, rho=rho, delta=delta, norm_by_std=norm_by_std, eps=eps)
    z = ref_z(gains, kinds, fin, eps=eps)
    return [a[st_[s]] + lam * z[s] for s in range(len(st_))]


# --------------------------------------------------------------------------- strategies


@st.composite
def batches(draw, *, binary=None, max_groups=5, max_size=16):
    """A random multi-session batch: groups of size 1-16 with arbitrary id values,
    trajectories in random order, 1-8 sessions each, one final per trajectory. A trajectory is either of
    main / compaction / subagent sessions (1-3 kinds, final main) or, in about a quarter of the batches'
    trajectories, of context-reset sessions only (kind 3, final reset: ``harness.mode=reset``), so the
    properties of §4.5 are checked with reset sessions in the batch beside the other kinds."""
    n_groups = draw(st.integers(1, max_groups))
    ids = draw(st.lists(st.integers(-(10**9), 10**9), min_size=n_groups, max_size=n_groups, unique=True))
    sizes = draw(st.lists(st.integers(1, max_size), min_size=n_groups, max_size=n_groups))
    g = [gid for gid, s in zip(ids, sizes, strict=True) for _ in range(s)]
    t = len(g)
    perm = draw(st.permutations(range(t)))
    g = [g[i] for i in perm]
    is_binary = draw(st.booleans()) if binary is None else binary
    if is_binary:
        r = [float(x) for x in draw(st.lists(st.integers(0, 1), min_size=t, max_size=t))]
        ok = [x == 1.0 for x in r]
    else:
        r = draw(st.lists(st.floats(0, 1, allow_nan=False, width=32), min_size=t, max_size=t))
        ok = [x >= 0.5 for x in r]
    n = draw(st.lists(st.integers(1, 8), min_size=t, max_size=t))
    n_kinds = draw(st.integers(1, 3))
    st_, kinds, fin = [], [], []
    resets = draw(st.lists(st.integers(0, 3), min_size=t, max_size=t))
    for i in range(t):
        for k in range(n[i]):
            st_.append(i)
            if resets[i] == 0:
                kinds.append(KIND_CODES["reset"])
            else:
                kinds.append(0 if k == n[i] - 1 else draw(st.integers(0, n_kinds - 1)))
            fin.append(k == n[i] - 1)
    gains = draw(st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=len(st_), max_size=len(st_)))
    return dict(r=r, g=g, n=n, ok=ok, st=st_, gains=gains, kinds=kinds, fin=fin)


def _tensors(b):
    return (
        torch.tensor(b["r"], dtype=torch.float32),
        torch.tensor(b["g"], dtype=torch.int64),
        torch.tensor(b["n"], dtype=torch.int64),
        torch.tensor(b["ok"]),
        torch.tensor(b["st"], dtype=torch.int64),
        torch.tensor(b["gains"], dtype=torch.float32),
        torch.tensor(b["kinds"], dtype=torch.int64),
        torch.tensor(b["fin"]),
    )


# --------------------------------------------------------------------------- §4.6 worked example

EX_R = [1.0, 0.0, 1.0, 0.0]
EX_N = [3, 5, 1, 1]
EX_ST = [0, 0, 0, 1, 1, 1, 1, 1, 2, 3]
EX_KINDS = [0, 1, 0, 0, 1, 0, 1, 0, 0, 0]  # 0 main, 1 compaction
EX_GAINS = [0.5, -0.2, 9.0, -0.1, -1.0, 0.3, -0.4, 7.0, 5.0, 0.2]
EX_FIN = [False, False, True, False, False, False, False, True, True, True]


def test_worked_example_spec_4_6():
    r, g, ok = torch.tensor(EX_R), torch.tensor([3, 3, 3, 3]), torch.tensor(EX_R) == 1
    n = torch.tensor(EX_N)
    torch.testing.assert_close(grpo(r, g), torch.tensor([0.8660, -0.8660, 0.8660, -0.8660]), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        session_aware(r, g, n, ok), torch.tensor([0.6928, -0.6928, 1.0392, -1.0392]), atol=1e-4, rtol=0
    )
    z = normalized_session_gains(torch.tensor(EX_GAINS), torch.tensor(EX_KINDS), torch.tensor(EX_FIN))
    torch.testing.assert_close(
        z, torch.tensor([0.8729, 0.8006, 0, -1.0911, -1.1209, 0.2182, 0.3203, 0, 0, 0]), atol=1e-4, rtol=0
    )
    out = mosaic(r, g, n, ok, torch.tensor(EX_ST), torch.tensor(EX_GAINS), torch.tensor(EX_KINDS), torch.tensor(EX_FIN),
                 rho=0.2, delta=0.1, lam=0.1)  # fmt: skip
    expected = [0.7801, 0.7729, 0.6928, -0.8019, -0.8049, -0.6710, -0.6608, -0.6928, 1.0392, -1.0392]
    torch.testing.assert_close(out, torch.tensor(expected), atol=1e-4, rtol=0)
    assert out.dtype == torch.float32


def test_worked_example_with_reset_sessions():
    """§4.6 with reset sessions: relabelling main as reset changes nothing (z is per kind, whatever its code);
    when trajectory 1 runs in reset mode (five reset sessions), its four non-final gains are z-scored as their
    own kind, and the lone non-final main and compaction sessions left get 0."""
    r, g, ok = torch.tensor(EX_R), torch.tensor([3, 3, 3, 3]), torch.tensor(EX_R) == 1
    n, st_ = torch.tensor(EX_N), torch.tensor(EX_ST)
    gains, fin = torch.tensor(EX_GAINS), torch.tensor(EX_FIN)
    reset = KIND_CODES["reset"]
    relabelled = torch.tensor([reset if k == 0 else k for k in EX_KINDS])
    torch.testing.assert_close(mosaic(r, g, n, ok, st_, gains, relabelled, fin),
                               mosaic(r, g, n, ok, st_, gains, torch.tensor(EX_KINDS), fin))
    kinds = [0, 1, 0, reset, reset, reset, reset, reset, 0, 0]
    z = normalized_session_gains(gains, torch.tensor(kinds), fin)
    torch.testing.assert_close(z, torch.tensor(ref_z(EX_GAINS, kinds, EX_FIN), dtype=torch.float32), atol=1e-5, rtol=0)
    assert z[0] == 0 and z[1] == 0 and z[3:7].abs().min() > 0 and abs(float(z[3:7].mean())) < 1e-5
    out = mosaic(r, g, n, ok, st_, gains, torch.tensor(kinds), fin)
    ref = ref_mosaic(EX_R, [3, 3, 3, 3], EX_N, list(ok.tolist()), EX_ST, EX_GAINS, kinds, EX_FIN)
    torch.testing.assert_close(out, torch.tensor(ref, dtype=torch.float32), atol=1e-5, rtol=0)


def test_numpy_inputs_and_dtypes():
    out = grpo(np.array(EX_R, dtype=np.float32), np.array([1, 1, 1, 1]))
    assert out.dtype == torch.float32
    assert grpo(torch.tensor(EX_R, dtype=torch.float64), torch.tensor([1, 1, 1, 1])).dtype == torch.float64
    with pytest.raises(ValueError, match="1-D"):
        grpo(torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="length"):
        grpo(torch.zeros(3), torch.zeros(2))


def test_grpo_conventions():
    # Singleton group → 0 (docs/algorithm.md §4.1 choice); constant group → 0; Dr. GRPO centring only.
    r = torch.tensor([0.7, 1.0, 1.0, 0.0, 1.0])
    g = torch.tensor([9, 4, 4, -2, -2])
    torch.testing.assert_close(grpo(r, g), torch.tensor([0.0, 0.0, 0.0, -0.7071, 0.7071]), atol=1e-4, rtol=0)
    torch.testing.assert_close(grpo(r, g, norm_by_std=False), torch.tensor([0.0, 0.0, 0.0, -0.5, 0.5]))
    assert grpo(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_centred_ranks_ties_and_singletons():
    u = centred_ranks(torch.tensor([3, 1, 3, 7, 5, 2]), torch.tensor([0, 0, 0, 0, 1, 2]))
    # segment 0: values 3,1,3,7 → avg ranks 2.5,1,2.5,4 → u = 2(R-1)/3 - 1
    torch.testing.assert_close(u, torch.tensor([0.0, -1.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64))


def test_uniform_groups_get_fallback_terms():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    n = torch.tensor([1, 2, 3, 4, 1])
    out = session_aware(r, g, n, r == 1, delta=0.1)
    # all-success: fewer sessions → +δ; all-failure: more sessions → +δ (giving up early is worse)
    torch.testing.assert_close(out, torch.tensor([0.1, 0.0, -0.1, 0.1, -0.1]))


def test_fractional_ordering_needs_failures_at_or_below_the_mean():
    """Pins a docs/algorithm.md §4.5 caveat: with fractional rewards a failure above the group mean
    has a positive A, and the (1 - ρu) multipliers can lift it over a success."""
    r = torch.tensor([1.0, 1.0, 0.95, 0.0, 0.0])
    ok = r >= 1.0
    n = torch.tensor([5, 1, 1, 3, 3])
    out = session_aware(r, torch.zeros(5, dtype=torch.long), n, ok)
    assert out[2] > out[0]  # failure (fewest sessions) above the many-session success


# --------------------------------------------------------------------------- loop ≡ vectorised


@SETTINGS
@given(batches(), st.booleans(), st.sampled_from([0.0, 0.2, 0.5]), st.sampled_from([0.0, 0.1]))
def test_vectorised_matches_loop_reference(b, norm, rho, lam):
    r, g, n, ok, st_, gains, kinds, fin = _tensors(b)
    out = mosaic(r, g, n, ok, st_, gains, kinds, fin, rho=rho, delta=0.1, lam=lam, norm_by_std=norm)
    ref = ref_mosaic(b["r"], b["g"], b["n"], b["ok"], b["st"], b["gains"], b["kinds"], b["fin"],
                     rho=rho, delta=0.1, lam=lam, norm_by_std=norm)  # fmt: skip
    np.testing.assert_allclose(out.numpy(), np.array(ref, dtype=np.float64), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grpo(r, g, norm_by_std=norm).numpy(), ref_grpo(b["r"], b["g"], norm_by_std=norm),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


# --------------------------------------------------------------------------- §4.5 properties


def _group_slices(g):
    return [np.flatnonzero(g == v) for v in np.unique(g)]


@SETTINGS
@given(batches(binary=True))
def test_mixed_groups_keep_grpo_sign_and_outcome_order(b):
    r, g, n, ok, *_ = _tensors(b)
    a = grpo(r, g).numpy()
    ah = session_aware(r, g, n, ok).numpy()
    okn = ok.numpy()
    for idx in _group_slices(g.numpy()):
        if okn[idx].all() or not okn[idx].any():
            continue
        np.testing.assert_array_equal(np.sign(ah[idx]), np.sign(a[idx]))
        assert ah[idx][~okn[idx]].max() <= ah[idx][okn[idx]].min()


@SETTINGS
@given(batches(binary=False))
def test_fractional_order_holds_when_failures_are_at_or_below_the_mean(b):
    r, g, n, ok, *_ = _tensors(b)
    a = grpo(r, g).numpy()
    ah = session_aware(r, g, n, ok).numpy()
    okn = ok.numpy()
    for idx in _group_slices(g.numpy()):
        if okn[idx].all() or not okn[idx].any():
            continue
        np.testing.assert_array_equal(np.sign(ah[idx]), np.sign(a[idx]))
        if a[idx][~okn[idx]].max() <= 0 <= a[idx][okn[idx]].min():
            assert ah[idx][~okn[idx]].max() <= ah[idx][okn[idx]].min() + 1e-6


@SETTINGS
@given(batches(binary=True), st.booleans())
def test_rho_zero_and_delta_zero_give_grpo(b, norm):
    r, g, n, ok, *_ = _tensors(b)
    out = session_aware(r, g, n, ok, rho=0.0, delta=0.0, norm_by_std=norm)
    torch.testing.assert_close(out, grpo(r, g, norm_by_std=norm))


@SETTINGS
@given(batches())
def test_rho_zero_gives_grpo_in_mixed_groups(b):
    r, g, n, ok, *_ = _tensors(b)
    out = session_aware(r, g, n, ok, rho=0.0).numpy()
    a = grpo(r, g).numpy()
    okn = ok.numpy()
    for idx in _group_slices(g.numpy()):
        if okn[idx].any() and not okn[idx].all():
            np.testing.assert_allclose(out[idx], a[idx], rtol=1e-6, atol=1e-7)


@SETTINGS
@given(batches(binary=True), st.integers(1, 8))
def test_equal_session_counts_give_grpo(b, count):
    r, g, _, ok, *_ = _tensors(b)
    n = torch.full_like(g, count)
    torch.testing.assert_close(session_aware(r, g, n, ok), grpo(r, g))


@SETTINGS
@given(batches())
def test_lambda_zero_gives_trajectory_advantage_on_every_session(b):
    r, g, n, ok, st_, gains, kinds, fin = _tensors(b)
    out = mosaic(r, g, n, ok, st_, gains, kinds, fin, lam=0.0)
    torch.testing.assert_close(out, broadcast(session_aware(r, g, n, ok), st_))


@SETTINGS
@given(batches(), st.randoms(use_true_random=False))
def test_permutation_equivariance(b, rnd):
    r, g, n, ok, st_, gains, kinds, fin = _tensors(b)
    out = mosaic(r, g, n, ok, st_, gains, kinds, fin)
    t, s = r.shape[0], st_.shape[0]
    pt = torch.tensor(rnd.sample(range(t), t))  # new trajectory i is old pt[i]
    inv_pt = torch.argsort(pt)
    ps = torch.tensor(rnd.sample(range(s), s))
    out_p = mosaic(r[pt], g[pt], n[pt], ok[pt], inv_pt[st_[ps]], gains[ps], kinds[ps], fin[ps])
    torch.testing.assert_close(out_p, out[ps], rtol=1e-5, atol=1e-6)
    # Relabelling group ids (any values) changes nothing.
    relabel = g * 7919 - 3
    torch.testing.assert_close(mosaic(r, relabel, n, ok, st_, gains, kinds, fin), out)


@SETTINGS
@given(batches())
def test_fallback_terms_sum_to_zero_per_group(b):
    r, g, n, ok, *_ = _tensors(b)
    out = session_aware(r, g, n, ok, delta=0.3).to(torch.float64).numpy()
    okn = ok.numpy()
    for idx in _group_slices(g.numpy()):
        if okn[idx].all() or not okn[idx].any():
            assert abs(out[idx].sum()) < 1e-6
            assert np.abs(out[idx]).max() <= 0.3 + 1e-7


@SETTINGS
@given(batches(), st.floats(-1e6, 1e6, allow_nan=False))
def test_finite_for_any_finite_input(b, c):
    r, g, n, ok, st_, gains, kinds, fin = _tensors(b)
    for rr in (r, torch.full_like(r, c)):  # also constant rewards
        for gg in (gains, torch.full_like(gains, c), gains * 1e6):
            for ff in (fin, torch.ones_like(fin), torch.zeros_like(fin)):  # incl. every kind empty
                out = mosaic(rr, g, n, ok, st_, gg, kinds, ff)
                assert torch.isfinite(out).all()
    singletons = torch.arange(r.shape[0])
    assert torch.isfinite(mosaic(r, singletons, n, ok, st_, gains, kinds, fin)).all()
    assert (session_aware(r, singletons, n, ok) == 0).all()


@SETTINGS
@given(batches())
def test_z_scores_are_standardised_per_kind(b):
    _, _, _, _, _, gains, kinds, fin = _tensors(b)
    z = normalized_session_gains(gains, kinds, fin).to(torch.float64)
    assert (z[fin] == 0).all()
    for k in torch.unique(kinds):
        sel = (kinds == k) & ~fin
        if int(sel.sum()) >= 2 and float(gains[sel].std()) > 1e-3:
            assert abs(float(z[sel].mean())) < 1e-4
            assert abs(float(z[sel].std()) - 1.0) < 1e-3
        elif int(sel.sum()) < 2:
            assert (z[sel] == 0).all()


# --------------------------------------------------------------------------- §4.7 turn level


def test_turn_level_gamma_zero_is_turn_gain_z():
    r, g, ok, n = torch.tensor(EX_R), torch.zeros(4, dtype=torch.long), torch.tensor(EX_R) == 1, torch.tensor(EX_N)
    before = torch.zeros(10)
    after = torch.tensor(EX_GAINS)
    out = turn_level(r, g, n, ok, torch.tensor(EX_ST), before, after, torch.tensor(EX_KINDS), torch.tensor(EX_FIN))
    expected = mosaic(r, g, n, ok, torch.tensor(EX_ST), after, torch.tensor(EX_KINDS), torch.tensor(EX_FIN))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(
        turn_level_gains(before + 1.0, after + 1.0, torch.tensor(EX_KINDS), torch.tensor(EX_FIN)),
        normalized_session_gains(after, torch.tensor(EX_KINDS), torch.tensor(EX_FIN)),
    )


@SETTINGS
@given(batches(), st.sampled_from([0.5, 0.9, 1.0]), st.randoms(use_true_random=False))
def test_turn_level_discounting_matches_loop(b, gamma, rnd):
    r, g, n, ok, tt, gains, kinds, fin = _tensors(b)  # sessions stand in for turns here
    # Interleave trajectories at random while keeping each trajectory's turns in order:
    # random keys, re-dealt in ascending order to each trajectory's turns.
    keys = [rnd.random() for _ in range(tt.shape[0])]
    for t in set(tt.tolist()):
        idx = [i for i in range(tt.shape[0]) if int(tt[i]) == t]
        for i, k in zip(idx, sorted(keys[i] for i in idx), strict=True):
            keys[i] = k
    order = torch.tensor(sorted(range(tt.shape[0]), key=keys.__getitem__), dtype=torch.long)
    tt, gains, kinds, fin = tt[order], gains[order], kinds[order], fin[order]
    out = turn_level(r, g, n, ok, tt, torch.zeros_like(gains), gains, kinds, fin, gamma=gamma, lam=0.1)
    z = normalized_session_gains(gains, kinds, fin).tolist()
    a = session_aware(r, g, n, ok).tolist()
    ref = []
    for u in range(tt.shape[0]):
        later = [v for v in range(u, tt.shape[0]) if int(tt[v]) == int(tt[u])]
        ref.append(a[int(tt[u])] + 0.1 * sum(gamma**j * z[v] for j, v in enumerate(later)))
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- registry


def _example_batch(gains=True) -> AdvantageBatch:
    return AdvantageBatch(
        rewards=torch.tensor(EX_R),
        group_ids=torch.zeros(4, dtype=torch.long),
        session_counts=torch.tensor(EX_N),
        success=torch.tensor(EX_R) == 1,
        session_traj=torch.tensor(EX_ST),
        kinds=torch.tensor(EX_KINDS),
        is_final=torch.tensor(EX_FIN),
        gains=torch.tensor(EX_GAINS) if gains else None,
    )


def test_registry_names_and_values():
    assert set(ESTIMATORS) >= {"grpo", "broadcast", "mosaic", "mosaic-traj", "mosaic-session"}
    b = _example_batch()
    a = torch.tensor([0.8660, -0.8660, 0.8660, -0.8660])
    ah = torch.tensor([0.6928, -0.6928, 1.0392, -1.0392])
    z = normalized_session_gains(b.gains, b.kinds, b.is_final)
    st_ = b.session_traj
    expected = {
        "broadcast": a[st_],
        "mosaic-traj": ah[st_],
        "mosaic-session": a[st_] + 0.1 * z,
        "mosaic": ah[st_] + 0.1 * z,
    }
    for name, exp in expected.items():
        est = get_estimator(name)
        out, metrics = est(b, kind_names={0: "main", 1: "compaction"})
        torch.testing.assert_close(out, exp, atol=1e-4, rtol=0, msg=name)
        assert est.needs_gains == (name in ("mosaic", "mosaic-session"))
        assert metrics["critic/advantages/mean"] == pytest.approx(float(out.mean()), abs=1e-6)
        for key in ("std", "min", "max"):
            assert f"critic/advantages/{key}" in metrics
        # non-final main gains 0.5, -0.1, 0.3 → 2/3 positive; compaction -0.2, -1.0, -0.4 → 0
        assert metrics["session/pos_gain_share/main"] == pytest.approx(2 / 3)
        assert metrics["session/pos_gain_share/compaction"] == 0.0


def test_registry_grpo_is_single_session_and_errors_are_clear():
    single = AdvantageBatch(
        rewards=torch.tensor(EX_R), group_ids=torch.zeros(4, dtype=torch.long), session_counts=torch.ones(4),
        success=torch.tensor(EX_R) == 1, session_traj=torch.tensor([3, 2, 1, 0]), kinds=torch.zeros(4),
        is_final=torch.ones(4, dtype=torch.bool),
    )  # fmt: skip
    out, metrics = get_estimator("grpo")(single)
    torch.testing.assert_close(out, torch.tensor([-0.8660, 0.8660, -0.8660, 0.8660]), atol=1e-4, rtol=0)
    assert "session/pos_gain_share/kind_0" not in metrics  # no gains given
    with pytest.raises(ValueError, match="single-session"):
        get_estimator("grpo")(_example_batch())
    with pytest.raises(ValueError, match="needs AdvantageBatch.gains"):
        get_estimator("mosaic")(_example_batch(gains=False))
    with pytest.raises(ValueError, match=re.escape(", ".join(sorted(ESTIMATORS)))):
        get_estimator("ppo")
    with pytest.raises(ValueError, match="kinds"):
        AdvantageBatch(rewards=torch.zeros(2), group_ids=torch.zeros(2), session_counts=torch.ones(2),
                       success=torch.zeros(2), session_traj=torch.tensor([0, 1]), kinds=torch.zeros(3),
                       is_final=torch.ones(2))  # fmt: skip
    _, metrics = get_estimator("mosaic")(_example_batch())
    assert "session/pos_gain_share/kind_1" in metrics  # default kind names


def _batch_of(b, *, downstream=None, valid=None):
    r, g, n, ok, st_, gains, kinds, fin = _tensors(b)
    return AdvantageBatch(rewards=r, group_ids=g, session_counts=n, success=ok, session_traj=st_, kinds=kinds,
                          is_final=fin, gains=gains, downstream=downstream, gain_valid=valid)


@SETTINGS
@given(batches(), st.randoms(use_true_random=False))
def test_mosaic_dag_is_mosaic_on_the_downstream_credit_and_keeps_its_properties(b, rnd):
    """§4.10: mosaic-dag is §4.4's formula with D in place of g, so §4.5 holds for it unchanged."""
    r, g, n, ok, st_, gains, kinds, fin = _tensors(b)
    d = torch.tensor([rnd.uniform(-3, 3) for _ in range(st_.shape[0])], dtype=torch.float32)
    est = get_estimator("mosaic-dag")
    out, m = est(_batch_of(b, downstream=d))
    torch.testing.assert_close(out, mosaic(r, g, n, ok, st_, d, kinds, fin))
    assert torch.isfinite(out).all()
    # λ = 0: the trajectory term alone
    lam0, _ = est(_batch_of(b, downstream=d), lam=0.0)
    torch.testing.assert_close(lam0, broadcast(session_aware(r, g, n, ok), st_))
    # the immediate gains do not enter it (they only share the credit before, in the scorer)
    other, _ = est(_batch_of(b, downstream=d), rho=0.2)
    b2 = dict(b, gains=[x + 1.0 for x in b["gains"]])
    torch.testing.assert_close(est(_batch_of(b2, downstream=d), rho=0.2)[0], other)
    assert any(k.startswith("session/pos_downstream_share/") for k in m) or bool(fin.all())


@SETTINGS
@given(batches(), st.randoms(use_true_random=False))
def test_sessions_without_a_reference_are_left_out_like_finals(b, rnd):
    """§4.11: a session with no answer to probe gets z = 0 and does not move any kind's statistics."""
    r, g, n, ok, st_, gains, kinds, fin = _tensors(b)
    valid = torch.tensor([rnd.random() < 0.7 for _ in range(st_.shape[0])])
    for name in ("mosaic", "mosaic-session"):
        out, m = get_estimator(name)(_batch_of(b, valid=valid))
        as_final, _ = get_estimator(name)(AdvantageBatch(rewards=r, group_ids=g, session_counts=n, success=ok,
                                                         session_traj=st_, kinds=kinds, is_final=fin | ~valid,
                                                         gains=gains))  # fmt: skip
        torch.testing.assert_close(out, as_final)
        assert m["session/no_reference_share"] == pytest.approx(float((~valid).float().mean()))
