"""Trajectory-token-mean inside verl: scaled advantages + verl's stock ``token-mean`` loss == ours (runs in .venv-verl)."""

from __future__ import annotations

import numpy as np
import torch
from omegaconf import OmegaConf

import verl  # noqa: F401
from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss

from mosaic.core.loss import policy_loss, token_weights
from mosaic.integrations.verl.rows import trajectory_token_scale


def _rows(seed: int):
    rng = np.random.default_rng(seed)
    b, l = 10, 8
    mask = torch.from_numpy(rng.random((b, l)) < 0.7)
    mask[:, 0] = True
    mask[4] = False  # a row without trainable tokens
    traj = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])  # sessions of 4 trajectories
    old = torch.from_numpy(rng.normal(-1.5, 0.5, (b, l)).astype(np.float32))
    new = (old + torch.from_numpy(rng.normal(0, 0.4, (b, l)).astype(np.float32))).requires_grad_(True)
    adv = torch.from_numpy(rng.normal(0, 1, b).astype(np.float32))
    return mask, traj, old, new, adv


def test_scaled_advantages_with_verls_token_mean_equal_our_trajectory_token_mean():
    mask, traj, old, new, adv = _rows(0)
    w = token_weights(mask.sum(-1), traj, mode="trajectory-token-mean")
    ours = policy_loss(new, old, adv, mask, w, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    (g_ours,) = torch.autograd.grad(ours.loss, new)

    scale = trajectory_token_scale(mask.sum(-1), traj)  # what the Mosaic estimators apply
    adv_tok = (adv * scale)[:, None].expand_as(new) * mask  # (B, L), as verl stores advantages
    pg, clipfrac, _, _ = compute_policy_loss(old_log_prob=old, log_prob=new, advantages=adv_tok,
                                             response_mask=mask.float(), cliprange_low=0.2, cliprange_high=0.28,
                                             clip_ratio_c=3.0, loss_agg_mode="token-mean")  # fmt: skip
    (g_verl,) = torch.autograd.grad(pg, new)
    torch.testing.assert_close(pg, ours.pg_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_verl, g_ours, rtol=1e-4, atol=1e-7)
    assert 0 < float(clipfrac) < 1  # clipping (and dual clip) really happened


def test_micro_batches_with_the_global_token_count_add_up_to_the_batch_loss():
    """verl passes the global token count to ``agg_loss``; the scaled rows then split freely."""
    mask, traj, old, new, adv = _rows(1)
    scale = trajectory_token_scale(mask.sum(-1), traj)
    loss_mat = -(adv * scale)[:, None] * torch.exp(new - old)  # any per-token loss linear in the advantage
    full = agg_loss(loss_mat, mask.float(), "token-mean")
    n = int(mask.sum())
    parts = sum(agg_loss(loss_mat[i], mask[i].float(), "token-mean", batch_num_tokens=n)
                for i in (slice(0, 3), slice(3, 7), slice(7, 10)))  # fmt: skip
    torch.testing.assert_close(parts, full)
    w = token_weights(mask.sum(-1), traj, mode="trajectory-token-mean")
    torch.testing.assert_close(full, (w[:, None] * mask * -adv[:, None] * torch.exp(new - old)).sum())


def test_scale_is_one_per_token_on_average_and_zero_for_empty_rows():
    mask, traj, *_ = _rows(2)
    scale = trajectory_token_scale(mask.sum(-1), traj)
    n = mask.sum(-1).float()
    torch.testing.assert_close((scale * n).sum() / n.sum(), torch.tensor(1.0))
    assert scale[4] == 0


def test_config_block_reaches_the_estimators():
    from mosaic.integrations.verl.rows import VerlParams

    p = VerlParams.from_config(OmegaConf.create({"mosaic": {"rho": 0.3, "loss_agg": "as-is"}}))
    assert (p.rho, p.loss_agg, p.lam) == (0.3, "as-is", 0.1)
    assert VerlParams.from_config(OmegaConf.create({})) == VerlParams()
