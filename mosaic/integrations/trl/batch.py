"""From one generation batch of trajectories, spread over data-parallel ranks, to what one rank trains on.

No TRL here (importable without it): :class:`~mosaic.integrations.trl.trainer.MosaicGRPOTrainer` calls
these after gathering every rank's trajectories, and the cross-engine test calls them directly.

Every quantity that mixes sessions — the group statistics of the outcome advantage, the per-kind
z-scores of the information gains, the trajectory-token-mean normaliser — is computed over the
**global** batch (all ranks), exactly as :mod:`mosaic.train.batch` and ``mosaic.train.rl.update`` do
in one process; each rank then keeps its own sessions. ``scope="rank"`` computes them over the rank's
own trajectories instead (what a per-rank implementation would do; kept to show that it trains
differently, see ``tests/integrations/trl``).

The loss of a rank is ``world_size * sum(w * pg)`` over its tokens: data-parallel training averages
the ranks' gradients, so the sum over every rank's tokens with the global weights comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from mosaic.core.estimators import get_estimator
from mosaic.core.loss import token_weights
from mosaic.trace.graph import Trajectory
from mosaic.trace.rows import TrainingRow, turn_layout
from mosaic.train.batch import Scores, compute_advantages, training_rows
from mosaic.train.batching import collate, pack_rows
from mosaic.config.loader import Config

__all__ = ["Scope", "RankBatch", "sample_indices", "concat_scores", "rank_batch", "row_tensors", "ROW_KEYS"]

Scope = Literal["global", "rank"]


@dataclass
class RankBatch:
    """One rank's share of a generation batch."""

    rows: list[TrainingRow]
    """This rank's sessions (one row per session), advantages set."""
    weights: torch.Tensor
    """(len(rows),) per-token weight of each row, normalised so that the loss ``world_size * sum(w * pg)``
    summed over the ranks' gradients is the whole batch's loss."""
    advantages: torch.Tensor
    """The estimator's output on the batch it was computed on: (S,) per session or (U,) per turn."""
    metrics: dict[str, float] = field(default_factory=dict)


def sample_indices(task_ids: Sequence[str]) -> list[int]:
    """For each row of the global batch, how many rows before it carry the same task: its sample number
    in the task's group, the same whatever the number of ranks the rows are spread over."""
    seen: dict[str, int] = {}
    out = []
    for t in task_ids:
        out.append(seen.get(t, 0))
        seen[t] = out[-1] + 1
    return out


def concat_scores(parts: Sequence[Scores]) -> Scores:
    """The scores of the concatenated batches (rank-major, as the trajectories are gathered)."""
    def cat(name):
        vals = [getattr(p, name) for p in parts]
        if all(v is None for v in vals):
            return None
        if any(v is None for v in vals):
            raise ValueError(f"scores.{name} is missing on some ranks")
        return torch.cat([torch.as_tensor(v) for v in vals])
    how = [p.downstream_how for p in parts]
    return Scores(gains=cat("gains"), is_final=cat("is_final"), turn_gains=cat("turn_gains"),
                  downstream=cat("downstream"), gain_valid=cat("gain_valid"),
                  downstream_how=None if any(h is None for h in how) else [x for h in how for x in h], metrics={})


def _score_slice(scores: Scores, trajs: Sequence[Trajectory], keep: range) -> Scores:
    """``scores`` (over ``trajs``) restricted to the trajectories ``keep``."""
    sess = [len(t.sessions) for t in trajs]
    s0, s1 = sum(sess[: keep.start]), sum(sess[: keep.stop])
    out = Scores(metrics={})
    if scores.gains is not None:
        out.gains, out.is_final = scores.gains[s0:s1], scores.is_final[s0:s1]
    for name in ("downstream", "gain_valid", "downstream_how"):
        if getattr(scores, name) is not None:
            setattr(out, name, getattr(scores, name)[s0:s1])
    if scores.turn_gains is not None:
        layout = turn_layout(trajs)
        sel = (layout.session >= s0) & (layout.session < s1)
        out.turn_gains = scores.turn_gains[torch.from_numpy(sel)]
    return out


def rank_batch(trajs: Sequence[Trajectory], scores: Scores, cfg: Config, local: range, *,
               world_size: int, scope: Scope = "global") -> RankBatch:  # fmt: skip
    """Advantages and loss weights of the rank that holds trajectories ``local`` of the gathered ``trajs``.

    ``scores``: the gains over all of ``trajs`` (flatten order), as the estimator asks for them.
    ``scope="global"``: statistics and normalisers over all of ``trajs``; ``"rank"``: over ``local`` only.
    """
    est = get_estimator(cfg.algo.estimator)
    if scope == "rank":
        scores, trajs, local = _score_slice(scores, trajs, local), list(trajs[local.start:local.stop]), \
            range(0, local.stop - local.start)  # fmt: skip
    elif scope != "global":
        raise ValueError(f"scope must be 'global' or 'rank', got {scope!r}")
    layout = turn_layout(trajs) if est.needs_turns else None
    adv, metrics = compute_advantages(trajs, cfg, scores, layout=layout)
    rows = training_rows(trajs, adv, est, layout)
    w = token_weights([r.num_trainable for r in rows], [r.traj_index for r in rows], mode=cfg.algo.loss_agg)
    if scope == "rank":  # each rank normalised on its own; the data-parallel mean then averages the ranks
        w = w / world_size
    keep = [i for i, r in enumerate(rows) if local.start <= r.traj_index < local.stop]
    return RankBatch(rows=[rows[i] for i in keep], weights=w[keep], advantages=adv, metrics=metrics)


ROW_KEYS = ("input_ids", "attention_mask", "completion_ids", "loss_mask", "old_logprobs", "prompt_lens",
            "completion_lens", "advantages", "token_rows", "token_weights")
"""The tensors of :func:`row_tensors` (first dimension: the packed rows)."""


def row_tensors(rb: RankBatch, *, pad_id: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """The rank's rows as padded tensors (sessions whose ids prefix a longer session of the same trajectory
    packed into it, as our trainer does), with per-token advantages and weights.

    The number of rows is padded to a multiple of ``multiple`` (TRL splits a generation batch into
    ``steps_per_generation`` equal chunks and drops a remainder) with copies of the first row that
    train nothing (mask and weight 0).
    """
    if not rb.rows:
        raise ValueError("a rank has no training rows: every trajectory has at least one session")
    packed = pack_rows(rb.rows)
    b = collate(packed, range(len(packed)), pad_id=pad_id)
    out = {k: getattr(b, k) for k in ROW_KEYS if k != "token_weights"}
    out["token_weights"] = b.token_weights(rb.weights)
    extra = (-len(packed)) % multiple
    if extra:
        for k, v in out.items():
            filler = v[:1].repeat(extra, *([1] * (v.dim() - 1)))
            if k in ("loss_mask", "token_weights", "advantages"):
                filler = torch.zeros_like(filler)
            elif k == "token_rows":
                filler = torch.full_like(filler, -1)
            out[k] = torch.cat([v, filler])
    return out
