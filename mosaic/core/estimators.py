"""Advantage estimators by name: one batch type, one call signature, metrics.

The trainer picks an estimator with ``get_estimator(name)`` and knows nothing of
the algorithm behind it. Every estimator returns per-session advantages (S,) —
one training row per session — plus a flat dict of metrics.

| name | per-session advantage |
| --- | --- |
| ``grpo`` | single-session GRPO: ``A_i`` on the trajectory's one session (fails loud on more) |
| ``broadcast`` | ``A_i`` copied to every session (SPEC §4.2) |
| ``mosaic-traj`` | session-aware ``Â_i`` broadcast, no gains (§4.3) |
| ``mosaic-session`` | ``A_i + lam z`` (GRPO broadcast plus gains, §4.4 without §4.3) |
| ``mosaic`` | ``Â_i + lam z`` (§4.3 + §4.4) |
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from mosaic.core import advantages as adv

__all__ = ["AdvantageBatch", "Estimator", "ESTIMATORS", "get_estimator", "advantage_metrics"]


@dataclass(frozen=True)
class AdvantageBatch:
    """Everything an estimator may read, for one training batch.

    Trajectory-level fields have length T, session-level fields length S.
    """

    rewards: torch.Tensor
    """(T,) outcome rewards in [0, 1]."""
    group_ids: torch.Tensor
    """(T,) integer group (task) id of each trajectory; groups may differ in size."""
    session_counts: torch.Tensor
    """(T,) number of sessions of each trajectory."""
    success: torch.Tensor
    """(T,) bool outcome flag (reward >= success threshold)."""
    session_traj: torch.Tensor
    """(S,) index into T of each session's trajectory."""
    kinds: torch.Tensor
    """(S,) integer session-kind code of each session."""
    is_final: torch.Tensor
    """(S,) bool, True for each trajectory's final main session."""
    gains: torch.Tensor | None = None
    """(S,) information gains ``L(after) - L(before)``; None when not scored."""

    def __post_init__(self) -> None:
        t = self.rewards.shape[0]
        s = self.session_traj.shape[0]
        for name in ("group_ids", "session_counts", "success"):
            if getattr(self, name).shape != (t,):
                raise ValueError(f"AdvantageBatch.{name} must have shape ({t},) like rewards")
        for name in ("kinds", "is_final") + (("gains",) if self.gains is not None else ()):
            if getattr(self, name).shape != (s,):
                raise ValueError(f"AdvantageBatch.{name} must have shape ({s},) like session_traj")
        if s and (int(self.session_traj.min()) < 0 or int(self.session_traj.max()) >= t):
            raise ValueError(f"AdvantageBatch.session_traj must index into the {t} trajectories")


def advantage_metrics(
    advantages: torch.Tensor,
    batch: AdvantageBatch,
    kind_names: Mapping[int, str] | None = None,
) -> dict[str, float]:
    """Advantage statistics (verl's ``critic/advantages/*`` keys) and, when gains
    are given, the share of non-final sessions with positive gain per kind
    (``session/pos_gain_share/<kind>``; kind name from ``kind_names`` or ``kind_<code>``)."""
    a = advantages.to(torch.float64)
    m: dict[str, float] = {}
    if a.numel():
        m["critic/advantages/mean"] = float(a.mean())
        m["critic/advantages/std"] = float(a.std()) if a.numel() > 1 else 0.0
        m["critic/advantages/min"] = float(a.min())
        m["critic/advantages/max"] = float(a.max())
    if batch.gains is not None:
        live = ~batch.is_final.to(torch.bool)
        for code in torch.unique(batch.kinds[live]).tolist():  # loop over kinds (a handful), not sessions
            sel = live & (batch.kinds == code)
            name = (kind_names or {}).get(int(code), f"kind_{int(code)}")
            m[f"session/pos_gain_share/{name}"] = float((batch.gains[sel] > 0).to(torch.float64).mean())
    return m


@dataclass(frozen=True)
class Estimator:
    """A named advantage estimator; call it on an :class:`AdvantageBatch`."""

    name: str
    needs_gains: bool
    fn: Callable[..., torch.Tensor]

    def __call__(
        self,
        batch: AdvantageBatch,
        *,
        rho: float = 0.2,
        delta: float = 0.1,
        lam: float = 0.1,
        norm_by_std: bool = True,
        eps: float = 1e-6,
        kind_names: Mapping[int, str] | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns (advantages (S,), metrics)."""
        if self.needs_gains and batch.gains is None:
            raise ValueError(f"estimator {self.name!r} needs AdvantageBatch.gains (information gains)")
        out = self.fn(batch, rho=rho, delta=delta, lam=lam, norm_by_std=norm_by_std, eps=eps)
        return out, advantage_metrics(out, batch, kind_names)


def _grpo(b: AdvantageBatch, *, rho, delta, lam, norm_by_std, eps) -> torch.Tensor:
    per_traj = torch.bincount(b.session_traj.long(), minlength=b.rewards.shape[0])
    if bool((per_traj != 1).any()):
        raise ValueError(
            "estimator 'grpo' is single-session: every trajectory needs exactly one session "
            "(use 'broadcast' for multi-session rollouts)"
        )
    return adv.broadcast(adv.grpo(b.rewards, b.group_ids, norm_by_std=norm_by_std, eps=eps), b.session_traj)


def _broadcast(b: AdvantageBatch, *, rho, delta, lam, norm_by_std, eps) -> torch.Tensor:
    return adv.broadcast(adv.grpo(b.rewards, b.group_ids, norm_by_std=norm_by_std, eps=eps), b.session_traj)


def _mosaic_traj(b: AdvantageBatch, *, rho, delta, lam, norm_by_std, eps) -> torch.Tensor:
    a_hat = adv.session_aware(
        b.rewards, b.group_ids, b.session_counts, b.success, rho=rho, delta=delta, norm_by_std=norm_by_std, eps=eps
    )
    return adv.broadcast(a_hat, b.session_traj)


def _mosaic_session(b: AdvantageBatch, *, rho, delta, lam, norm_by_std, eps) -> torch.Tensor:
    a = adv.grpo(b.rewards, b.group_ids, norm_by_std=norm_by_std, eps=eps)
    z = adv.normalized_session_gains(b.gains, b.kinds, b.is_final, eps=eps)
    return adv.broadcast(a, b.session_traj).to(z.dtype) + lam * z


def _mosaic(b: AdvantageBatch, *, rho, delta, lam, norm_by_std, eps) -> torch.Tensor:
    return adv.mosaic(
        b.rewards, b.group_ids, b.session_counts, b.success, b.session_traj, b.gains, b.kinds, b.is_final,
        rho=rho, delta=delta, lam=lam, norm_by_std=norm_by_std, eps=eps,
    )  # fmt: skip


ESTIMATORS: dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("grpo", False, _grpo),
        Estimator("broadcast", False, _broadcast),
        Estimator("mosaic-traj", False, _mosaic_traj),
        Estimator("mosaic-session", True, _mosaic_session),
        Estimator("mosaic", True, _mosaic),
    )
}


def get_estimator(name: str) -> Estimator:
    """The estimator registered under ``name``; ValueError listing the valid names otherwise."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(sorted(ESTIMATORS))}") from None
