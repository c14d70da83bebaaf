"""Advantage estimators by name: one batch type, one call signature, metrics.

The trainer picks an estimator with ``get_estimator(name)`` and knows nothing of
the algorithm behind it. An estimator returns per-session advantages (S,) — one
training row per session — or, when its ``level`` is ``"turn"``, per-turn
advantages (U,) that the trainer spreads over each turn's tokens; plus a flat dict
of metrics.

| name | advantage |
| --- | --- |
| ``grpo`` | single-session GRPO: ``A_i`` on the trajectory's one session (fails loud on more) |
| ``broadcast`` | ``A_i`` copied to every session (docs/algorithm.md §4.2) |
| ``mosaic-traj`` | session-aware ``Â_i`` broadcast, no gains (§4.3) |
| ``mosaic-session`` | ``A_i + lam z`` (GRPO broadcast plus gains, §4.4 without §4.3) |
| ``mosaic`` | ``Â_i + lam z`` (§4.3 + §4.4) |
| ``turn-level`` | per turn: ``A_i + lam z_turn`` (IGPO-style, §4.7) |
| ``fold`` | per turn: ``A_i``, minus ``p`` on main turns past half the context budget (FoldGRPO-style, §4.8) |

Adding an estimator means adding one entry to :data:`ESTIMATORS` (and its function) here: the
trainer scores gains or lays out turns from ``Estimator.needs`` and ``Estimator.level``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from mosaic.core import advantages as adv

__all__ = ["AdvantageBatch", "Estimator", "EstimatorParams", "ESTIMATORS", "get_estimator", "advantage_metrics"]


@dataclass(frozen=True)
class AdvantageBatch:
    """Everything an estimator may read, for one training batch.

    Trajectory-level fields have length T, session-level fields length S and
    turn-level fields length U (a turn: one run of sampled tokens and the
    inserted tokens after it, see ``mosaic.trace.turn_spans``). The optional
    fields are filled only for the estimators that declare them in ``Estimator.needs``.
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
    turn_session: torch.Tensor | None = None
    """(U,) index into S of each turn's session (turns of a session in order)."""
    turn_gains: torch.Tensor | None = None
    """(U,) per-turn information gains ``L(after turn) - L(before turn)`` (docs/algorithm.md §4.7)."""
    turn_is_final: torch.Tensor | None = None
    """(U,) bool, True for the answer turn (the last turn of a final session)."""
    turn_over_half: torch.Tensor | None = None
    """(U,) bool, True for a main-session turn taken while its context exceeds half the budget (§4.8)."""

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
        if self.turn_session is not None:
            u = self.turn_session.shape[0]
            for name in ("turn_gains", "turn_is_final", "turn_over_half"):
                v = getattr(self, name)
                if v is not None and v.shape != (u,):
                    raise ValueError(f"AdvantageBatch.{name} must have shape ({u},) like turn_session")
            if u and (int(self.turn_session.min()) < 0 or int(self.turn_session.max()) >= s):
                raise ValueError(f"AdvantageBatch.turn_session must index into the {s} sessions")


@dataclass(frozen=True)
class EstimatorParams:
    """The knobs estimators read (each estimator uses the ones it needs; ``algo.*`` in the trainer config)."""

    rho: float = 0.2
    """ρ, session-count rank term in mixed groups (§4.3)."""
    delta: float = 0.1
    """δ, all-success / all-failure fallback term (§4.3)."""
    lam: float = 0.1
    """λ, weight of the z-scored information gain (§4.4, §4.7)."""
    gamma: float = 0.0
    """Discount of later turns' gains in the turn-level estimator (0: each turn its own gain; §4.7)."""
    fold_penalty: float = 1.0
    """p, FoldGRPO-style penalty on main turns taken past half the context budget (§4.8)."""
    norm_by_std: bool = True
    """Divide by the group std (GRPO); False = Dr. GRPO."""
    eps: float = 1e-6
    """Added to standard deviations."""


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
    """A named advantage estimator; call it on an :class:`AdvantageBatch`.

    ``needs`` names the optional :class:`AdvantageBatch` fields it reads (the trainer scores gains
    or lays out turns only when an estimator asks); ``level`` says whether it returns one advantage
    per session (S,) or per turn (U,); ``single_session`` estimators refuse multi-session rollouts.
    """

    name: str
    fn: Callable[[AdvantageBatch, EstimatorParams], torch.Tensor]
    doc: str
    needs: frozenset[str] = frozenset()
    level: Literal["session", "turn"] = "session"
    single_session: bool = False

    @property
    def needs_gains(self) -> bool:
        return "gains" in self.needs

    @property
    def needs_turns(self) -> bool:
        return self.level == "turn" or any(n.startswith("turn_") for n in self.needs)

    def __call__(
        self,
        batch: AdvantageBatch,
        params: EstimatorParams | None = None,
        *,
        kind_names: Mapping[int, str] | None = None,
        **overrides: float | bool,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Returns (advantages (S,) or (U,) by ``level``, metrics). ``overrides`` replace fields of ``params``."""
        p = dataclasses.replace(params or EstimatorParams(), **overrides)
        for field_name in sorted(self.needs):
            if getattr(batch, field_name) is None:
                raise ValueError(f"estimator {self.name!r} needs AdvantageBatch.{field_name}")
        if self.level == "turn" and batch.turn_session is None:
            raise ValueError(f"estimator {self.name!r} needs AdvantageBatch.turn_session (turn layout)")
        out = self.fn(batch, p)
        metrics = advantage_metrics(out, batch, kind_names)
        if batch.turn_gains is not None and batch.turn_is_final is not None:
            live = ~batch.turn_is_final.to(torch.bool)
            if bool(live.any()):
                metrics["turn/pos_gain_share"] = float((batch.turn_gains[live] > 0).to(torch.float64).mean())
        return out, metrics


def _outcome(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    return adv.grpo(b.rewards, b.group_ids, norm_by_std=p.norm_by_std, eps=p.eps)


def _grpo(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    per_traj = torch.bincount(b.session_traj.long(), minlength=b.rewards.shape[0])
    if bool((per_traj != 1).any()):
        raise ValueError(
            "estimator 'grpo' is single-session: every trajectory needs exactly one session "
            "(use 'broadcast' for multi-session rollouts)"
        )
    return adv.broadcast(_outcome(b, p), b.session_traj)


def _broadcast(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    return adv.broadcast(_outcome(b, p), b.session_traj)


def _mosaic_traj(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    a_hat = adv.session_aware(b.rewards, b.group_ids, b.session_counts, b.success, rho=p.rho, delta=p.delta,
                              norm_by_std=p.norm_by_std, eps=p.eps)  # fmt: skip
    return adv.broadcast(a_hat, b.session_traj)


def _mosaic_session(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    z = adv.normalized_session_gains(b.gains, b.kinds, b.is_final, eps=p.eps)
    return adv.broadcast(_outcome(b, p), b.session_traj).to(z.dtype) + p.lam * z


def _mosaic(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    return adv.mosaic(
        b.rewards, b.group_ids, b.session_counts, b.success, b.session_traj, b.gains, b.kinds, b.is_final,
        rho=p.rho, delta=p.delta, lam=p.lam, norm_by_std=p.norm_by_std, eps=p.eps,
    )  # fmt: skip


def _turn_level(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    # GRPO outcome (rho = delta = 0) plus the per-kind z-scored turn gain: mosaic-session at turn granularity.
    ts = b.turn_session.long()
    turn_traj = b.session_traj.index_select(0, ts)
    zeros = torch.zeros_like(b.turn_gains, dtype=torch.float64)
    return adv.turn_level(b.rewards, b.group_ids, b.session_counts, b.success, turn_traj, zeros, b.turn_gains,
                          b.kinds.index_select(0, ts), b.turn_is_final, rho=0.0, delta=0.0, lam=p.lam,
                          gamma=p.gamma, norm_by_std=p.norm_by_std, eps=p.eps)  # fmt: skip


def _fold(b: AdvantageBatch, p: EstimatorParams) -> torch.Tensor:
    ts = b.turn_session.long()
    a = _outcome(b, p).index_select(0, b.session_traj.index_select(0, ts))
    return a - p.fold_penalty * b.turn_over_half.to(a.dtype)


ESTIMATORS: dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("grpo", _grpo, "single-session GRPO: A_i on the trajectory's one session", single_session=True),
        Estimator("broadcast", _broadcast, "A_i copied to every session (4.2)"),
        Estimator("mosaic-traj", _mosaic_traj, "session-aware trajectory advantage, broadcast (4.3)"),
        Estimator("mosaic-session", _mosaic_session, "A_i + lam z_session (4.4 without 4.3)",
                  needs=frozenset({"gains"})),
        Estimator("mosaic", _mosaic, "session-aware advantage + lam z_session (4.3 + 4.4)",
                  needs=frozenset({"gains"})),
        Estimator("turn-level", _turn_level, "IGPO-style: A_i + lam z_turn on each turn's tokens (4.7)",
                  needs=frozenset({"turn_gains", "turn_is_final"}), level="turn"),
        Estimator("fold", _fold, "FoldGRPO-style: A_i, minus p on main turns past half the budget (4.8)",
                  needs=frozenset({"turn_over_half"}), level="turn"),
    )
}
"""The one registry of estimators: the trainer config, the CLI and the docs read their names from here."""


def get_estimator(name: str) -> Estimator:
    """The estimator registered under ``name``; ValueError listing the valid names otherwise."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(sorted(ESTIMATORS))}") from None
