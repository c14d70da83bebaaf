"""Glue from trajectories (+ scored gains) to the advantage estimators.

The trainer calls :func:`compute_advantages` with the batch's trajectories and,
for the estimators that need them, the gains from :mod:`mosaic.train.scorer`;
it gets back one advantage per session in :func:`mosaic.trace.flatten` order —
the order of :func:`mosaic.trace.to_rows` — and the estimator's metrics.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mosaic.core.estimators import AdvantageBatch, get_estimator
from mosaic.trace.graph import Trajectory, kind_names
from mosaic.trace.rows import flatten
from mosaic.train.config import AlgoConfig

__all__ = ["advantage_batch", "compute_advantages"]


def advantage_batch(trajs: Sequence[Trajectory], gains=None, *, count_kinds: Sequence[str] | None = None) -> AdvantageBatch:
    """An :class:`AdvantageBatch` from trajectories; ``gains``: (S,) in flatten order or None."""
    fb = flatten(trajs, count_kinds=count_kinds)
    g = None
    if gains is not None:
        g = torch.as_tensor(gains, dtype=torch.float32)
        if g.shape != (len(fb.kinds),):
            raise ValueError(f"gains has shape {tuple(g.shape)}, expected ({len(fb.kinds)},) sessions in flatten order")
    return AdvantageBatch(
        rewards=torch.from_numpy(fb.rewards), group_ids=torch.from_numpy(fb.group_ids),
        session_counts=torch.from_numpy(fb.session_counts), success=torch.from_numpy(fb.success),
        session_traj=torch.from_numpy(fb.session_traj), kinds=torch.from_numpy(fb.kinds),
        is_final=torch.from_numpy(fb.is_final), gains=g,
    )  # fmt: skip


def compute_advantages(trajs: Sequence[Trajectory], algo: AlgoConfig, gains=None) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-session advantages (S,) with the configured estimator, and its metrics."""
    est = get_estimator(algo.estimator)
    if est.needs_gains and gains is None:
        raise ValueError(f"algo.estimator={algo.estimator!r} needs information gains: score the batch first")
    batch = advantage_batch(trajs, gains if est.needs_gains else None, count_kinds=algo.count_kinds)
    return est(batch, rho=algo.rho, delta=algo.delta, lam=algo.lam, norm_by_std=algo.norm_by_std, eps=algo.eps,
               kind_names=kind_names())  # fmt: skip
