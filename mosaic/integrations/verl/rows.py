"""verl's per-row batch (one row per session) → :class:`~mosaic.core.estimators.AdvantageBatch` → per-row advantages.

No verl import here: this is the arithmetic the verl estimators run, testable anywhere.

A row is one session's ``AgentLoopOutput``. The agent loop (:mod:`.agent_loop`) writes these
``extra_fields``, which verl turns into ``non_tensor_batch`` columns of the same names:

| column | meaning |
| --- | --- |
| ``uid`` (verl's own) | the group: every rollout of one prompt shares it |
| ``mosaic_traj`` | the trajectory (one agent-loop run) the session belongs to; unique within the batch |
| ``mosaic_kind`` | session kind (``main``, ``compaction``, ``subagent``, ...) |
| ``mosaic_final`` | True for the trajectory's final main session (exactly one per trajectory) |
| ``mosaic_sessions`` | the trajectory's session count (the count §4.3 ranks) |
| ``mosaic_gain`` | the session's information gain ``L(after) - L(before)`` (NaN when not scored; final: ignored) |
| ``mosaic_downstream`` | optional: the session's downstream credit (§4.10; NaN when not scored), for ``mosaic-dag`` |

The trajectory's outcome reward is read from its final row's token-level rewards (their sum), as
verl's multi-output advantage reads the last output's reward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from mosaic.core.estimators import ESTIMATORS, KNOBS, AdvantageBatch, EstimatorParams, get_estimator
from mosaic.core.loss import token_weights
from mosaic.trace.graph import KIND_CODES, kind_names

__all__ = ["COLUMNS", "OPTIONAL_COLUMNS", "VERL_OWN_KEYS", "VerlParams", "advantage_batch_from_rows", "row_advantages", "trajectory_token_scale"]

COLUMNS = ("mosaic_traj", "mosaic_kind", "mosaic_final", "mosaic_sessions", "mosaic_gain")
"""The ``non_tensor_batch`` columns the Mosaic estimators read (besides verl's ``uid``)."""
OPTIONAL_COLUMNS = ("mosaic_downstream",)
"""Columns read when present (the agent loop writes them when asked: ``mosaic.downstream=true``)."""


VERL_OWN_KEYS = {"norm_by_std": "norm_adv_by_std_in_grpo"}
"""Estimator knobs verl already has a key for (``algorithm.<key>``): read from there, refused under ``mosaic``."""


@dataclass(frozen=True)
class VerlParams:
    """Knobs of the verl estimators: ``algorithm.mosaic.<name>`` in verl's config (all optional): every
    estimator knob of the registry (``mosaic.core.estimators.KNOBS``: ``rho``, ``delta``, ``lam``, ...) that
    a registered verl estimator reads, but those in :data:`VERL_OWN_KEYS`, plus the two fields below.
    ``params.rho`` reads a knob."""

    knobs: EstimatorParams = field(default_factory=EstimatorParams)
    """The estimator knobs (the registry's defaults where the config is silent)."""
    success_threshold: float = 1.0
    """A trajectory succeeds when its reward is at least this (§3)."""
    loss_agg: Literal["trajectory-token-mean", "as-is"] = "trajectory-token-mean"
    """``trajectory-token-mean``: scale each row's advantage so that verl's ``token-mean`` loss weighs
    every trajectory the same (§5); ``as-is``: leave the advantages unscaled (verl's own aggregation)."""

    def __post_init__(self) -> None:
        if self.loss_agg not in ("trajectory-token-mean", "as-is"):
            raise ValueError(f"algorithm.mosaic.loss_agg must be 'trajectory-token-mean' or 'as-is', "
                             f"got {self.loss_agg!r}")  # fmt: skip

    def __getattr__(self, name: str):
        if name == "knobs":  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.knobs, name)

    @staticmethod
    def keys() -> list[str]:
        """The valid ``algorithm.mosaic`` keys: the knobs the registered verl estimators read (``Estimator.knobs``)."""
        from mosaic.integrations.verl import estimator_names

        read = {k for name in set(estimator_names().values()) for k in ESTIMATORS[name].knobs}
        return [k for k in KNOBS if k in read and k not in VERL_OWN_KEYS] + ["success_threshold", "loss_agg"]

    @staticmethod
    def from_config(config: Any) -> VerlParams:
        """From verl's ``algorithm`` config (a DictConfig or mapping; ``mosaic`` sub-key optional)."""
        sub = config.get("mosaic") if config is not None and hasattr(config, "get") else None
        if sub is None:
            return VerlParams()
        own = sorted(set(sub.keys()) & set(VERL_OWN_KEYS))
        if own:
            raise ValueError(f"algorithm.mosaic.{own[0]}: set verl's own algorithm.{VERL_OWN_KEYS[own[0]]} instead")
        extra = set(sub.keys()) - set(VerlParams.keys())
        if extra:
            raise ValueError(f"unknown algorithm.mosaic keys {sorted(extra)}; valid: {sorted(VerlParams.keys())}")
        knobs = {}
        for k in set(sub.keys()) & set(KNOBS):
            knob, v = KNOBS[k], sub[k]
            ok = isinstance(v, bool) if knob.type is bool else isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok or (knob.type is int and not isinstance(v, int)):
                raise ValueError(f"algorithm.mosaic.{k} must be a {knob.type.__name__}, got {v!r}")
            why = knob.check(v)
            if why:
                raise ValueError(f"algorithm.mosaic.{k} {why}, got {v!r}")
            knobs[k] = knob.type(v)
        rest = {k: sub[k] for k in ("success_threshold", "loss_agg") if k in sub}
        return VerlParams(EstimatorParams(**knobs), **rest)


def _codes(values: Sequence[Any]) -> np.ndarray:
    """(R,) int64 codes of arbitrary hashable values (equal values, equal codes)."""
    _, inv = np.unique(np.asarray([str(v) for v in values], dtype=object).astype(str), return_inverse=True)
    return inv.astype(np.int64)


def advantage_batch_from_rows(
    row_rewards: np.ndarray,
    uid: Sequence[Any],
    columns: Mapping[str, Sequence[Any]],
    *,
    success_threshold: float = 1.0,
) -> AdvantageBatch:
    """The :class:`AdvantageBatch` of R session rows; its session axis is the row axis.

    Args:
        row_rewards: (R,) each row's outcome reward (only the final rows' values are read).
        uid: (R,) group of each row (verl's ``uid``).
        columns: the :data:`COLUMNS`, each (R,).
        success_threshold: success = reward >= this.

    Raises ValueError (naming the column) when a column is missing, a trajectory has no or several
    final rows, spans several groups, or its rows disagree on the session count.
    """
    missing = [c for c in COLUMNS if c not in columns]
    if missing:
        raise ValueError(f"verl batch lacks the Mosaic columns {missing}: run the 'mosaic_agent' agent loop (it "
                         "writes them as extra_fields) or add them to non_tensor_batch")  # fmt: skip
    r = len(uid)
    traj = _codes(columns["mosaic_traj"])  # (R,)
    final = np.asarray(columns["mosaic_final"], dtype=bool)
    counts = np.asarray(columns["mosaic_sessions"], dtype=np.int64)
    group = _codes(uid)
    t = int(traj.max()) + 1 if r else 0
    finals_per_traj = np.bincount(traj[final], minlength=t)
    if r and (finals_per_traj != 1).any():
        k = int(np.flatnonzero(finals_per_traj != 1)[0])
        name = np.asarray(columns["mosaic_traj"], dtype=object)[traj == k][0]
        raise ValueError(f"mosaic_final: trajectory {name!r} has {int(finals_per_traj[k])} final rows, "
                         "expected exactly one")
    first = np.full(t, -1, dtype=np.int64)
    first[traj[::-1]] = np.arange(r)[::-1]  # a representative row per trajectory
    if r and ((group != group[first][traj]).any() or (counts != counts[first][traj]).any()):
        raise ValueError("mosaic_traj: the rows of one trajectory must share uid and mosaic_sessions")
    final_row = np.empty(t, dtype=np.int64)
    final_row[traj[final]] = np.flatnonzero(final)
    rewards = np.asarray(row_rewards, dtype=np.float32)[final_row] if r else np.zeros(0, np.float32)
    kinds = [str(k) for k in columns["mosaic_kind"]]
    unknown = sorted(set(kinds) - set(KIND_CODES))
    if unknown:
        raise ValueError(f"mosaic_kind: unknown session kinds {unknown}; known: {sorted(KIND_CODES)}")
    gains, down = _per_session(columns, "mosaic_gain", final), _per_session(columns, "mosaic_downstream", final)
    return AdvantageBatch(
        rewards=torch.from_numpy(rewards), group_ids=torch.from_numpy(group[first]),
        session_counts=torch.from_numpy(counts[first]), success=torch.from_numpy(rewards >= success_threshold),
        session_traj=torch.from_numpy(traj), kinds=torch.tensor([KIND_CODES[k] for k in kinds], dtype=torch.int64),
        is_final=torch.from_numpy(final), gains=gains, downstream=down,
    )  # fmt: skip


def _per_session(columns: Mapping[str, Sequence[Any]], name: str, final: np.ndarray) -> torch.Tensor | None:
    """(R,) float32 of a per-session column, 0 on final rows; None when absent or NaN on a non-final row (not
    scored: an estimator that needs it says so)."""
    if name not in columns:
        return None
    v = np.asarray(columns[name], dtype=np.float64)
    if np.isnan(v[~final]).any():
        return None
    return torch.from_numpy(np.where(final, 0.0, v).astype(np.float32))


def trajectory_token_scale(row_tokens: torch.Tensor, row_traj: torch.Tensor) -> torch.Tensor:
    """(R,) positive factor per row: ``N / (n_traj * tokens_of_traj)``, ``N`` = trainable tokens in the batch.

    Multiplying each row's advantage by it makes verl's ``token-mean`` loss (``sum(mask * pg) / N``)
    equal our ``trajectory-token-mean`` (``sum(w * mask * pg)``, :func:`mosaic.core.loss.token_weights`):
    the clipped surrogate is positively homogeneous in the advantage (dual clip included). Its token
    mean is 1, so advantage statistics keep their scale on average. Rows without trainable tokens get 0.
    """
    w = token_weights(row_tokens, row_traj, mode="trajectory-token-mean").to(torch.float64)
    return (w * torch.as_tensor(row_tokens, dtype=torch.float64).sum()).to(torch.float32)


def row_advantages(
    verl_name: str,
    row_rewards: np.ndarray,
    uid: Sequence[Any],
    columns: Mapping[str, Sequence[Any]],
    row_tokens: torch.Tensor,
    params: VerlParams,
    *,
    norm_by_std: bool | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(R,) per-row advantages of the verl estimator ``verl_name`` (scaled by :func:`trajectory_token_scale`
    unless ``params.loss_agg == "as-is"``) and its metrics (``critic/advantages/*`` of the unscaled
    values, ``session/pos_gain_share/<kind>``)."""
    from mosaic.integrations.verl import estimator_names

    names = estimator_names()
    if verl_name not in names:
        raise ValueError(f"unknown Mosaic verl estimator {verl_name!r}; valid: {sorted(names)}")
    batch = advantage_batch_from_rows(row_rewards, uid, columns, success_threshold=params.success_threshold)
    est = get_estimator(names[verl_name])
    knobs = params.knobs if norm_by_std is None else params.knobs.replace(norm_by_std=norm_by_std)  # verl's own key
    adv, metrics = est(batch, knobs, kind_names=kind_names())
    adv = adv.to(torch.float32)
    if params.loss_agg == "trajectory-token-mean":
        adv = adv * trajectory_token_scale(row_tokens, batch.session_traj)
    return adv, metrics
