"""PPO clipped token loss with whole-batch normalisers (docs/algorithm.md §5).

One training row per session: ``(B, L)`` completion tokens with a boolean
``loss_mask``. **Mask convention (the only one in this project): True = a token
the policy sampled, which we train on.** Tool / environment / padding tokens are
False.

Length normalisation lives in one place, :func:`token_weights`: it turns
whole-batch metadata (trainable tokens per row, each row's trajectory) into one
weight per row, so that the loss of any micro-batch is
``sum(weight_row * mask * per_token_loss)`` and the micro-batch losses add up
to the full-batch loss exactly. Gradient accumulation and micro-batch size
therefore never change the update.

Aggregation modes (``loss_agg``):
- ``trajectory-token-mean`` (default): every trajectory weighs the same, and
  within it every trainable token across all its sessions weighs the same:
  ``w = 1 / (n_traj * tokens_of_traj)``.
- ``token-mean``: ``w = 1 / tokens_in_batch`` (verl's ``token-mean``).
- ``session-token-mean``: ``w = 1 / (n_rows * tokens_of_row)`` (verl's
  ``seq-mean-token-mean``).
Rows / trajectories without trainable tokens get weight 0 and are not counted.

Metrics are aggregated with the same weights, so they also add up over
micro-batches (``actor/ratio_max`` / ``_min`` are per call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = ["LossAgg", "LOSS_AGG_MODES", "token_weights", "kl_k3", "PolicyLossOutput", "policy_loss"]

LossAgg = Literal["trajectory-token-mean", "token-mean", "session-token-mean"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)


def token_weights(row_token_counts, row_traj, *, mode: LossAgg = "trajectory-token-mean") -> torch.Tensor:
    """Per-row weight of each trainable token, from whole-batch metadata.

    Args:
        row_token_counts: (R,) trainable tokens (``loss_mask.sum(-1)``) of every
            row in the **whole** batch.
        row_traj: (R,) trajectory index (any integers) of every row; only used
            by ``trajectory-token-mean``.
        mode: aggregation mode (see module docstring).

    Returns:
        (R,) float32 weights; ``sum_r weight_r * row_token_counts_r`` is 1 when
        the batch has any trainable token, else 0.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg mode {mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")
    n = torch.as_tensor(row_token_counts).to(torch.float64)
    tr = torch.as_tensor(row_traj)
    if n.dim() != 1 or tr.shape != n.shape:
        raise ValueError(
            f"row_token_counts and row_traj must be 1-D of equal length, got {tuple(n.shape)}, {tuple(tr.shape)}"
        )
    has = n > 0
    zero = torch.zeros_like(n)
    if mode == "token-mean":
        w = torch.where(has, 1.0 / n.sum().clamp(min=1.0), zero)
    elif mode == "session-token-mean":
        w = torch.where(has, 1.0 / (has.sum().clamp(min=1) * n.clamp(min=1.0)), zero)
    else:  # trajectory-token-mean
        _, inv = torch.unique(tr, return_inverse=True)
        n_tr = int(inv.max()) + 1 if inv.numel() else 0
        traj_tokens = torch.zeros(n_tr, dtype=torch.float64).index_add_(0, inv, n)  # (n_traj,)
        live_traj = (traj_tokens > 0).sum().clamp(min=1)
        w = torch.where(has, 1.0 / (live_traj * traj_tokens[inv].clamp(min=1.0)), zero)
    return w.to(torch.float32)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(policy || reference), per token: ``exp(d) - d - 1``, ``d = ref - logp``.

    Shapes: any, elementwise. ``d`` is clamped to [-20, 20] for stability (as verl).
    """
    d = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


@dataclass(frozen=True)
class PolicyLossOutput:
    """Result of :func:`policy_loss` for one (micro-)batch."""

    loss: torch.Tensor
    """Scalar to backpropagate: ``pg_loss + kl_coef * kl_loss``."""
    pg_loss: torch.Tensor
    """Scalar weighted clipped-surrogate loss."""
    kl_loss: torch.Tensor
    """Scalar weighted k3 KL to the reference (0 without a reference)."""
    metrics: dict[str, float]
    """``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/kl_loss``,
    ``actor/ratio_mean|max|min``, ``actor/entropy`` (when given)."""


def _kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, w_tok: torch.Tensor) -> torch.Tensor:
    """The weighted k3 KL to the reference, ``sum(w_tok * k3)``; all (B, L)."""
    # Off-mask inputs are replaced by 0 *before* the exp, so the backward never multiplies 0 by inf/NaN.
    zeros = torch.zeros_like(logprobs)
    kl = kl_k3(torch.where(mask, logprobs, zeros), torch.where(mask, ref_logprobs.detach(), zeros))
    return (w_tok * kl).sum()


def _loss_metrics(w_tok: torch.Tensor, mask: torch.Tensor, pg_loss: torch.Tensor, kl_loss: torch.Tensor,
                  log_ratio: torch.Tensor, ratio: torch.Tensor, *, clipped: torch.Tensor,
                  entropy: torch.Tensor | None) -> dict[str, float]:
    """The loss's metrics, each a ``w_tok``-weighted sum over the batch (``w_tok``: (B, L), 0 off-mask), so they
    aggregate exactly as the loss does; ``clipped``: (B, L) bool, the clipped branch was taken."""
    with torch.no_grad():
        wd = w_tok.detach()
        metrics = {
            "actor/pg_loss": float(pg_loss.detach()),
            "actor/pg_clipfrac": float((wd * clipped.to(wd.dtype)).sum()),
            "actor/ppo_kl": float((wd * -log_ratio.detach()).sum()),
            "actor/kl_loss": float(kl_loss.detach()),
            "actor/ratio_mean": float((wd * ratio.detach()).sum()),
            "actor/ratio_max": float(ratio[mask].max()) if bool(mask.any()) else 1.0,
            "actor/ratio_min": float(ratio[mask].min()) if bool(mask.any()) else 1.0,
        }
        if entropy is not None:
            metrics["actor/entropy"] = float((wd * torch.where(mask, entropy, torch.zeros_like(entropy))).sum())
    return metrics


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with clip-higher and optional k3 KL (docs/algorithm.md §5).

    Args:
        logprobs: (B, L) current policy log-probs of the completion tokens (with grad).
        old_logprobs: (B, L) log-probs under the sampling policy.
        advantages: (B,) per row (session) or (B, L) per token.
        loss_mask: (B, L) bool, True = sampled by the policy = trained.
        weights: (B,) per-token weight of each row from :func:`token_weights`
            computed over the whole batch, or (B, L) per token (rows that pack several
            sessions of one trajectory into one sequence carry each session's weight).
        clip_low, clip_high: ratio clipped to ``[1 - clip_low, 1 + clip_high]``.
        clip_ratio_c: dual-clip bound for negative advantages (verl's
            ``clip_ratio_c``); None disables it.
        ref_logprobs: (B, L) frozen reference log-probs; needed when ``kl_coef > 0``.
        kl_coef: β, weight of the k3 KL term.
        entropy: (B, L) per-token entropy, for metrics only.

    Returns:
        :class:`PolicyLossOutput`. With an all-False mask the loss is 0 and its
        gradient is 0 everywhere (never NaN).
    """
    mask = loss_mask.to(torch.bool)
    if logprobs.shape != mask.shape or old_logprobs.shape != mask.shape:
        raise ValueError(f"logprobs, old_logprobs and loss_mask must share shape (B, L), got {tuple(logprobs.shape)}, "
                         f"{tuple(old_logprobs.shape)}, {tuple(mask.shape)}")  # fmt: skip
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(-1).expand_as(logprobs) if adv.dim() == 1 else adv  # (B, L)
    w = weights.to(logprobs.dtype)
    w_tok = (w.unsqueeze(-1) if w.dim() == 1 else w) * mask  # (B, L), 0 off-mask
    # Masked positions get log-ratio 0 through `where`, so non-finite padding
    # log-probs there can never produce NaN values or gradients.
    log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs)).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # clip-higher
    pg = torch.maximum(pg1, pg2)
    if clip_ratio_c is not None:  # dual clip: bound the loss of very large ratios when A < 0
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * clip_ratio_c), pg)
    pg_loss = (w_tok * pg).sum()
    kl_loss = _kl_loss(logprobs, ref_logprobs, mask, w_tok) if ref_logprobs is not None else pg_loss.new_zeros(())
    loss = pg_loss + kl_coef * kl_loss
    metrics = _loss_metrics(w_tok, mask, pg_loss, kl_loss, log_ratio, ratio, clipped=pg2 > pg1, entropy=entropy)
    return PolicyLossOutput(loss=loss, pg_loss=pg_loss, kl_loss=kl_loss, metrics=metrics)
