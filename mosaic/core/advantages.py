"""Advantage estimators for multi-session trajectories (docs/algorithm.md §4).

Pure tensor functions: no I/O, no config objects. Tensors are positional,
hyper-parameters keyword-only; one left out takes its default from the knob table
(``mosaic.core.estimators.KNOBS``), where each is declared once. Shapes: ``T`` trajectories, ``S`` sessions,
``U`` turns. Every estimator groups by an explicit ``group_ids`` array (any
integer values, groups of any size), never by reshaping.

Everything is vectorised over the whole batch with segment operations
(``torch.unique(..., return_inverse=True)`` + ``index_add_``); there is no
Python loop over trajectories or groups. Statistics are computed in float64
and returned as float32 (float64 when the rewards / gains come in as float64),
so outputs are finite for any finite input.

Simplifications, stated once:
- a group of size 1 gets GRPO advantage 0 (docs/algorithm.md §4.1 choice; verl returns the
  raw score there);
- ``session_counts`` are whatever the caller counts (docs/algorithm.md §4.3: all kinds);
- the turn-level (IGPO-style) shaping reuses the per-kind z-scoring of §4.4 over
  turns instead of sessions; its optional discounting follows IGPO.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch

__all__ = [
    "grpo",
    "session_aware",
    "centred_ranks",
    "normalized_session_gains",
    "mosaic",
    "broadcast",
    "turn_level_gains",
    "turn_level",
]

_F64 = torch.float64


# --------------------------------------------------------------------------- helpers


KNOB_TABLE: dict = {}
"""The knob table (``mosaic.core.estimators.KNOBS``, the same dict: that module hands it over when it loads, and
``mosaic.core`` loads it first): where the hyper-parameters' defaults are declared, once."""


def _knob_defaults(fn):
    """Fill the keyword-only hyper-parameters a caller leaves out with their defaults from :data:`KNOB_TABLE`."""
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind is p.KEYWORD_ONLY and p.default is p.empty]  # fmt: skip

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for n in names:
            if n not in kwargs:
                kwargs[n] = KNOB_TABLE[n].default
        return fn(*args, **kwargs)

    return wrapper


def _as_tensor(x, name: str, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """1-D tensor from a tensor / numpy array / sequence; fails loud on other ranks."""
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    t = t.detach()
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t.to(dtype) if dtype is not None else t


def _out_dtype(*ts: torch.Tensor) -> torch.dtype:
    return _F64 if any(t.dtype == _F64 for t in ts) else torch.float32


def _check_len(n: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.shape[0] != n:
            raise ValueError(f"{name} has length {t.shape[0]}, expected {n}")


def _segment_mean_std(
    x: torch.Tensor, seg: torch.Tensor, n_seg: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-segment count, mean and Bessel-corrected std (0 for segments of size < 2).

    x: (N,) float64, seg: (N,) int64 in [0, n_seg). Returns three (n_seg,) tensors.
    Two passes (mean, then squared deviations) for numerical stability.
    """
    count = torch.zeros(n_seg, dtype=_F64, device=x.device).index_add_(0, seg, torch.ones_like(x))
    total = torch.zeros(n_seg, dtype=_F64, device=x.device).index_add_(0, seg, x)
    mean = total / count.clamp(min=1.0)
    sq = torch.zeros(n_seg, dtype=_F64, device=x.device).index_add_(0, seg, (x - mean.index_select(0, seg)) ** 2)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1.0), torch.zeros_like(sq))
    return count, mean, var.sqrt()


# --------------------------------------------------------------------------- §4.1 GRPO


@_knob_defaults
def grpo(rewards, group_ids, *, norm_by_std: bool, eps: float) -> torch.Tensor:
    """GRPO outcome advantage per trajectory (docs/algorithm.md §4.1).

    Args:
        rewards: (T,) outcome rewards.
        group_ids: (T,) integer group id of each trajectory (any values).
        norm_by_std: divide by the group std (False: Dr. GRPO, mean-centring only).
        eps: added to the std.

    Returns:
        (T,) ``A_i = (r_i - mean_g) / (std_g + eps)`` with ddof = 1; a singleton
        group gets 0.
    """
    r = _as_tensor(rewards, "rewards")
    out_dtype = _out_dtype(r)
    r = r.to(_F64)
    g = _as_tensor(group_ids, "group_ids")
    _check_len(r.shape[0], group_ids=g)
    if r.numel() == 0:
        return torch.zeros(0, dtype=out_dtype)
    _, inv = torch.unique(g, return_inverse=True)
    n_groups = int(inv.max()) + 1
    count, mean, std = _segment_mean_std(r, inv, n_groups)
    adv = r - mean.index_select(0, inv)  # §4.1 numerator
    if norm_by_std:
        adv = adv / (std.index_select(0, inv) + eps)  # §4.1, ddof = 1
    adv = torch.where(count.index_select(0, inv) > 1, adv, torch.zeros_like(adv))  # singleton → 0 (choice)
    return adv.to(out_dtype)


# --------------------------------------------------------------------------- §4.3 ranks


def centred_ranks(values, segment_ids) -> torch.Tensor:
    """Centred average rank of ``values`` within each segment (docs/algorithm.md §4.3).

    Ascending rank with ties given their average rank ``R ∈ [1, m]``, then
    ``u = 2 (R - 1) / (m - 1) - 1 ∈ [-1, 1]``; a segment of size 1 gives 0.
    Vectorised: one lexicographic sort by (segment, value) and run-length
    segment sums for the ties.

    Args:
        values: (N,) numbers to rank (session counts).
        segment_ids: (N,) integer segment id of each element (any values).

    Returns:
        (N,) float64 centred ranks, zero-sum within every segment.
    """
    v = _as_tensor(values, "values", dtype=_F64)
    s = _as_tensor(segment_ids, "segment_ids")
    _check_len(v.shape[0], segment_ids=s)
    n = v.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=_F64)
    _, seg = torch.unique(s, return_inverse=True)
    # Lexicographic sort: stable by value, then stable by segment.
    o1 = torch.sort(v, stable=True).indices
    o2 = torch.sort(seg.index_select(0, o1), stable=True).indices
    order = o1.index_select(0, o2)  # (N,) positions sorted by (segment, value)
    seg_s, v_s = seg.index_select(0, order), v.index_select(0, order)
    n_seg = int(seg.max()) + 1
    m = torch.bincount(seg, minlength=n_seg)  # (n_seg,) subgroup sizes
    start = torch.cumsum(m, 0) - m  # first sorted position of each segment
    pos = torch.arange(n, device=v.device) - start.index_select(0, seg_s)  # 0-based rank within segment
    # Runs of equal (segment, value) share the average of their positions.
    new_run = torch.ones(n, dtype=torch.bool, device=v.device)
    new_run[1:] = (seg_s[1:] != seg_s[:-1]) | (v_s[1:] != v_s[:-1])
    run = torch.cumsum(new_run.long(), 0) - 1
    n_run = int(run[-1]) + 1
    run_sum = torch.zeros(n_run, dtype=_F64).index_add_(0, run, pos.to(_F64))
    run_len = torch.bincount(run, minlength=n_run).to(_F64)
    r_avg = run_sum.index_select(0, run) / run_len.index_select(0, run) + 1.0  # R ∈ [1, m]
    m_s = m.index_select(0, seg_s).to(_F64)
    u_s = torch.where(m_s > 1, 2.0 * (r_avg - 1.0) / (m_s - 1.0).clamp(min=1.0) - 1.0, torch.zeros_like(r_avg))
    return torch.empty_like(u_s).scatter_(0, order, u_s)  # back to input order


# --------------------------------------------------------------------------- §4.3 Â


@_knob_defaults
def session_aware(
    rewards,
    group_ids,
    session_counts,
    success,
    *,
    rho: float,
    delta: float,
    norm_by_std: bool,
    eps: float,
) -> torch.Tensor:
    """Mosaic trajectory-level session-aware advantage ``Â`` (docs/algorithm.md §4.3).

    Args:
        rewards: (T,) outcome rewards.
        group_ids: (T,) integer group ids.
        session_counts: (T,) sessions per trajectory ``n_i``.
        success: (T,) bool (or 0/1) outcome flag.
        rho: strength of the rank modulation in mixed groups.
        delta: size of the fallback terms in all-success / all-failure groups.
        norm_by_std, eps: as in :func:`grpo`.

    Returns:
        (T,) ``Â``: mixed group ``A_i (1 - rho u_i)``; all-success ``-delta u_i``;
        all-failure ``+delta u_i``, with ``u_i`` the centred rank of ``n_i`` inside
        the trajectory's (group, outcome) subgroup.
    """
    r = _as_tensor(rewards, "rewards")
    out_dtype = _out_dtype(r)
    g = _as_tensor(group_ids, "group_ids")
    n = _as_tensor(session_counts, "session_counts")
    ok = _as_tensor(success, "success").to(torch.bool)
    _check_len(r.shape[0], group_ids=g, session_counts=n, success=ok)
    if r.numel() == 0:
        return torch.zeros(0, dtype=out_dtype)
    a = grpo(r.to(_F64), g, norm_by_std=norm_by_std, eps=eps)  # (T,) float64
    _, inv = torch.unique(g, return_inverse=True)
    n_groups = int(inv.max()) + 1
    u = centred_ranks(n, inv * 2 + ok.long())  # (T,) rank within (group, outcome)
    n_ok = torch.zeros(n_groups, dtype=torch.long).index_add_(0, inv, ok.long())
    size = torch.bincount(inv, minlength=n_groups)
    all_ok = (n_ok == size).index_select(0, inv)
    all_fail = (n_ok == 0).index_select(0, inv)
    mixed = ~(all_ok | all_fail)
    adv = torch.where(mixed, a * (1.0 - rho * u), torch.zeros_like(a))  # mixed: multiplier in [1-ρ, 1+ρ]
    adv = torch.where(all_ok, -delta * u, adv)  # all-success fallback, zero-mean
    adv = torch.where(all_fail, delta * u, adv)  # all-failure fallback, zero-mean
    return adv.to(out_dtype)


# --------------------------------------------------------------------------- §4.4 z


@_knob_defaults
def normalized_session_gains(gains, kinds, is_final, *, eps: float) -> torch.Tensor:
    """Per-kind z-scores of session information gains over the batch (docs/algorithm.md §4.4).

    Args:
        gains: (S,) ``g_k = L(state_after) - L(state_before)``.
        kinds: (S,) integer session-kind codes.
        is_final: (S,) bool, True for each trajectory's final session.
        eps: added to the std.

    Returns:
        (S,) ``z = (g - mean_kind) / (std_kind + eps)`` with ddof = 1 over the
        non-final sessions of that kind; final sessions get 0 and are left out of
        the statistics; a kind with fewer than two non-final sessions gets 0.
    """
    gn = _as_tensor(gains, "gains")
    out_dtype = _out_dtype(gn)
    gn = gn.to(_F64)
    k = _as_tensor(kinds, "kinds")
    fin = _as_tensor(is_final, "is_final").to(torch.bool)
    _check_len(gn.shape[0], kinds=k, is_final=fin)
    live = ~fin
    if not bool(live.any()):
        return torch.zeros(gn.shape[0], dtype=out_dtype)
    _, inv = torch.unique(k, return_inverse=True)
    n_kinds = int(inv.max()) + 1
    # Finals go to an extra dump segment so they never touch a kind's statistics.
    seg = torch.where(live, inv, torch.full_like(inv, n_kinds))
    count, mean, std = _segment_mean_std(gn, seg, n_kinds + 1)
    z = (gn - mean.index_select(0, seg)) / (std.index_select(0, seg) + eps)  # §4.4 z-score, ddof = 1
    z = torch.where(live & (count.index_select(0, seg) >= 2), z, torch.zeros_like(z))
    return z.to(out_dtype)


# --------------------------------------------------------------------------- §4.2 / §4.4


def broadcast(traj_adv, session_traj) -> torch.Tensor:
    """Copy each trajectory's advantage to its sessions (docs/algorithm.md §4.2).

    Args:
        traj_adv: (T,) per-trajectory advantage.
        session_traj: (S,) index into T of each session's trajectory.

    Returns:
        (S,) ``traj_adv[session_traj]``.
    """
    a = _as_tensor(traj_adv, "traj_adv")
    idx = _as_tensor(session_traj, "session_traj").long()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= a.shape[0]):
        raise ValueError(f"session_traj must index into {a.shape[0]} trajectories")
    return a.index_select(0, idx)


@_knob_defaults
def mosaic(
    rewards,
    group_ids,
    session_counts,
    success,
    session_traj,
    gains,
    kinds,
    is_final,
    *,
    rho: float,
    delta: float,
    lam: float,
    norm_by_std: bool,
    eps: float,
) -> torch.Tensor:
    """Mosaic per-session advantage ``A_{i,k} = Â_i + lam z_{i,k}`` (docs/algorithm.md §4.3-4.4).

    Args:
        rewards, group_ids, session_counts, success: (T,) as in :func:`session_aware`.
        session_traj: (S,) index into T of each session's trajectory.
        gains, kinds, is_final: (S,) as in :func:`normalized_session_gains`.

    Returns:
        (S,) per-session advantages.
    """
    a_hat = session_aware(
        rewards, group_ids, session_counts, success, rho=rho, delta=delta, norm_by_std=norm_by_std, eps=eps
    )
    z = normalized_session_gains(gains, kinds, is_final, eps=eps)
    _check_len(z.shape[0], session_traj=_as_tensor(session_traj, "session_traj"))
    out = broadcast(a_hat, session_traj).to(z.dtype) + lam * z  # §4.4
    return out.to(_out_dtype(a_hat, z))


# --------------------------------------------------------------------------- §4.7 turns


@_knob_defaults
def turn_level_gains(loglik_before, loglik_after, kinds, is_final, *, eps: float) -> torch.Tensor:
    """IGPO-style per-turn information gains, z-scored per kind (docs/algorithm.md §4.7).

    IGPO rewards each turn by how much it raised the policy's belief in the
    ground truth. Here, as in §4.4, a turn's gain is ``L(after) - L(before)``
    (mean per-token log-probability of the answer, one probe per turn), and the
    gains are z-scored per kind over the batch; turns flagged final (the turn
    that states the answer) get 0 and are excluded.

    Args:
        loglik_before: (U,) ``L`` of the context before each turn.
        loglik_after: (U,) ``L`` of the context after each turn.
        kinds: (U,) integer kind code of each turn's session.
        is_final: (U,) bool, True for answer turns.

    Returns:
        (U,) normalised per-turn gains.
    """
    before = _as_tensor(loglik_before, "loglik_before")
    after = _as_tensor(loglik_after, "loglik_after")
    _check_len(before.shape[0], loglik_after=after)
    gains = after.to(_F64) - before.to(_F64)
    return normalized_session_gains(gains, kinds, is_final, eps=eps).to(_out_dtype(before, after))


@_knob_defaults
def turn_level(
    rewards,
    group_ids,
    session_counts,
    success,
    turn_traj,
    loglik_before,
    loglik_after,
    kinds,
    is_final,
    *,
    rho: float,
    delta: float,
    lam: float,
    gamma: float,
    norm_by_std: bool,
    eps: float,
) -> torch.Tensor:
    """Per-turn advantage ``Â_i + lam * sum_{t' >= t} gamma^(t'-t) z_{t'}`` (docs/algorithm.md §4.7).

    ``gamma = 0`` credits each turn with its own gain only (the session-level
    recipe at turn granularity); ``gamma > 0`` adds IGPO's discounted sum of the
    later turns' gains in the same trajectory. Turns of a trajectory must appear
    in chronological order (turns of different trajectories may interleave).
    Use ``rho=0, delta=0`` for plain GRPO as the outcome term.

    Args:
        rewards, group_ids, session_counts, success: (T,) as in :func:`session_aware`.
        turn_traj: (U,) index into T of each turn's trajectory.
        loglik_before, loglik_after, kinds, is_final: (U,) as in :func:`turn_level_gains`.

    Returns:
        (U,) per-turn advantages; map them to tokens with each token's turn index.
    """
    a_hat = session_aware(
        rewards, group_ids, session_counts, success, rho=rho, delta=delta, norm_by_std=norm_by_std, eps=eps
    )
    z = turn_level_gains(loglik_before, loglik_after, kinds, is_final, eps=eps).to(_F64)
    tt = _as_tensor(turn_traj, "turn_traj").long()
    _check_len(z.shape[0], turn_traj=tt)
    shaped = z
    if gamma != 0.0 and z.numel():
        # Discounted reverse cumsum within each trajectory. The loop runs over turn
        # positions (at most the longest trajectory's turn count), vectorised over
        # trajectories: at step j every turn adds gamma^j z of the turn j later.
        order = torch.sort(tt, stable=True).indices  # chronological within trajectory
        tt_s, z_s = tt.index_select(0, order), z.index_select(0, order)
        n_t = torch.bincount(tt_s, minlength=a_hat.shape[0])
        start = torch.cumsum(n_t, 0) - n_t
        pos = torch.arange(tt_s.shape[0]) - start.index_select(0, tt_s)
        remaining = n_t.index_select(0, tt_s) - pos - 1  # turns after this one
        acc = z_s.clone()
        for j in range(1, int(remaining.max()) + 1):
            has = remaining >= j
            idx = torch.nonzero(has).squeeze(1)
            acc[idx] += gamma**j * z_s[idx + j]
        shaped = torch.empty_like(acc).scatter_(0, order, acc)
    out = broadcast(a_hat.to(_F64), tt) + lam * shaped
    return out.to(a_hat.dtype)
