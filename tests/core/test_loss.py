"""PPO loss and whole-batch aggregation (docs/algorithm.md §5): hand-computed values, masks,
micro-batch invariance, clip-higher, k3 KL."""

from __future__ import annotations

import math

import pytest
import torch

from mosaic.core.loss import LOSS_AGG_MODES, kl_k3, policy_loss, token_weights

# Three rows (sessions): trajectory 0 has rows 0 and 1, trajectory 1 has row 2.
MASK = torch.tensor([[True, True, False], [True, False, False], [True, False, False]])
ROW_TRAJ = torch.tensor([0, 0, 1])
ADV = torch.tensor([1.0, 2.0, -1.0])  # per row


def _loss(mode, logp=None, **kw):
    old = torch.full((3, 3), -1.0)
    logp = old.clone() if logp is None else logp
    w = token_weights(MASK.sum(-1), ROW_TRAJ, mode=mode)
    return policy_loss(logp, old, ADV, MASK, w, **kw)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # ratio 1 everywhere → per-token loss −A: row 0 [−1, −1], row 1 [−2], row 2 [1]
        ("token-mean", (-1 - 1 - 2 + 1) / 4),
        ("session-token-mean", (-1 + -2 + 1) / 3),  # mean of row means
        ("trajectory-token-mean", ((-1 - 1 - 2) / 3 + 1) / 2),  # mean of trajectory token means
    ],
)
def test_aggregation_modes_hand_computed(mode, expected):
    out = _loss(mode)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.metrics["actor/pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert out.metrics["actor/pg_clipfrac"] == 0.0
    assert out.metrics["actor/ratio_mean"] == pytest.approx(1.0)


def test_token_weights_values_and_validation():
    w = token_weights(torch.tensor([2, 1, 1]), ROW_TRAJ, mode="token-mean")
    torch.testing.assert_close(w, torch.full((3,), 0.25))
    torch.testing.assert_close(
        token_weights(torch.tensor([2, 1, 1]), ROW_TRAJ, mode="session-token-mean"), torch.tensor([1 / 6, 1 / 3, 1 / 3])
    )
    torch.testing.assert_close(
        token_weights(torch.tensor([2, 1, 1, 0]), torch.tensor([5, 5, 9, 11])), torch.tensor([1 / 6, 1 / 6, 1 / 2, 0.0])
    )  # default trajectory-token-mean; a trajectory without trainable tokens is not counted
    for mode in LOSS_AGG_MODES:
        assert (token_weights(torch.zeros(3, dtype=torch.long), ROW_TRAJ, mode=mode) == 0).all()
    with pytest.raises(ValueError, match="loss_agg mode 'seq-mean'"):
        token_weights(torch.tensor([1]), torch.tensor([0]), mode="seq-mean")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_tokens_get_zero_gradient_even_with_nonfinite_logprobs(mode):
    logp = torch.full((3, 3), -1.0)
    logp[~MASK] = -math.inf  # padding log-probs may be anything
    logp.requires_grad_(True)
    ref = torch.full((3, 3), -1.3)
    ref[~MASK] = math.nan
    out = _loss(mode, logp=logp, ref_logprobs=ref, kl_coef=0.1)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert (logp.grad[~MASK] == 0).all()
    assert (logp.grad[MASK] != 0).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_mask_keeps_backward_valid(mode):
    logp = torch.randn(2, 4, requires_grad=True)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    w = token_weights(mask.sum(-1), torch.tensor([0, 1]), mode=mode)
    out = policy_loss(logp, torch.randn(2, 4), torch.ones(2), mask, w, ref_logprobs=torch.randn(2, 4), kl_coef=0.1,
                      entropy=torch.rand(2, 4))  # fmt: skip
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert (logp.grad == 0).all()
    assert all(math.isfinite(v) for v in out.metrics.values())


def _random_batch(seed: int, rows: int = 7, width: int = 6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=g) < 0.6
    mask[1] = False  # a row with no trainable token
    row_traj = torch.tensor([0, 0, 0, 1, 2, 2, 3])[:rows]
    old = -torch.rand(rows, width, generator=g) * 2
    feats = torch.randn(rows, width, generator=g)
    adv = torch.randn(rows, generator=g)
    ref = old + 0.1 * torch.randn(rows, width, generator=g)
    return mask, row_traj, old, feats, adv, ref


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_size_never_changes_the_update(mode):
    mask, row_traj, old, feats, adv, ref = _random_batch(0)
    w = token_weights(mask.sum(-1), row_traj, mode=mode)  # from the whole batch
    rows = mask.shape[0]

    def grads(micro: int) -> tuple[torch.Tensor, float]:
        theta = torch.tensor(0.7, requires_grad=True)  # logp = old + theta * feats, ratios far from 1
        total = 0.0
        for s in range(0, rows, micro):
            sl = slice(s, s + micro)
            logp = old[sl] + theta * feats[sl]
            out = policy_loss(logp, old[sl], adv[sl], mask[sl], w[sl], ref_logprobs=ref[sl], kl_coef=0.05)
            out.loss.backward()  # gradient accumulation
            total += out.loss.item()
        return theta.grad.clone(), total

    g_full, l_full = grads(rows)
    assert g_full.abs() > 0
    for micro in (1, 2):
        g_micro, l_micro = grads(micro)
        torch.testing.assert_close(g_micro, g_full, rtol=1e-5, atol=1e-7)
        assert l_micro == pytest.approx(l_full, rel=1e-5, abs=1e-7)


def test_trajectory_split_into_ten_sessions_weighs_like_one():
    # Trajectory 0: 20 trainable tokens in 1 row, or the same tokens in 10 rows of 2.
    # Trajectory 1: one row of 4 tokens. Each trajectory must keep total weight 1/2.
    one = token_weights(torch.tensor([20, 4]), torch.tensor([0, 1]))
    ten = token_weights(torch.tensor([2] * 10 + [4]), torch.tensor([0] * 10 + [1]))
    assert float(one[0] * 20) == pytest.approx(0.5)
    assert float((ten[:10] * 2).sum()) == pytest.approx(0.5)
    assert float(ten[10] * 4) == pytest.approx(0.5)
    # ... and the loss is the same for the same tokens and advantages.
    g = torch.Generator().manual_seed(3)
    old0, new0 = -torch.rand(20, generator=g), -torch.rand(20, generator=g)
    old1, new1 = -torch.rand(4, generator=g), -torch.rand(4, generator=g)
    pad = torch.zeros(16)
    a = policy_loss(
        torch.stack([new0, torch.cat([new1, pad])]), torch.stack([old0, torch.cat([old1, pad])]),
        torch.tensor([1.5, -0.5]), torch.stack([torch.ones(20, dtype=torch.bool), torch.arange(20) < 4]), one,
    )  # fmt: skip
    b = policy_loss(
        torch.cat([torch.nn.functional.pad(new0.view(10, 2), (0, 2)), new1.view(1, 4)]),  # (11, 4)
        torch.cat([torch.nn.functional.pad(old0.view(10, 2), (0, 2)), old1.view(1, 4)]),
        torch.tensor([1.5] * 10 + [-0.5]),
        torch.cat([torch.arange(4).expand(10, 4) < 2, torch.ones(1, 4, dtype=torch.bool)]),
        ten,
    )  # fmt: skip
    assert a.loss.item() == pytest.approx(b.loss.item(), rel=1e-6)
    # session-token-mean is what over-weights split trajectories: 10/11 of the weight.
    sess = token_weights(torch.tensor([2] * 10 + [4]), torch.tensor([0] * 10 + [1]), mode="session-token-mean")
    assert float((sess[:10] * 2).sum()) == pytest.approx(10 / 11)


@pytest.mark.parametrize(
    ("adv", "ratio", "expected_loss", "clipped"),
    [
        (1.0, 1.5, -1.28, True),  # positive A: ratio capped at 1 + ε_high = 1.28
        (1.0, 1.2, -1.2, False),  # inside the clip-higher range (would clip at 1.2 with ε = 0.2)
        (1.0, 0.5, -0.5, False),  # positive A, low ratio: pessimistic min keeps the unclipped term
        (-1.0, 0.5, 0.8, True),  # negative A: ratio floored at 1 − ε_low = 0.8
        (-1.0, 0.85, 0.85, False),
        (-1.0, 1.5, 1.5, False),  # negative A, high ratio: unclipped (no dual clip by default)
    ],
)
def test_clip_higher(adv, ratio, expected_loss, clipped):
    old = torch.tensor([[-2.0]])
    logp = (old + math.log(ratio)).requires_grad_(True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    out = policy_loss(logp, old, torch.tensor([adv]), mask, torch.ones(1))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert out.metrics["actor/pg_clipfrac"] == (1.0 if clipped else 0.0)
    if clipped:
        assert float(logp.grad) == 0.0  # the clipped branch carries no gradient
    else:
        assert float(logp.grad) == pytest.approx(-adv * ratio, rel=1e-5)


def test_dual_clip_is_optional():
    old = torch.tensor([[-2.0]])
    logp = old + math.log(5.0)
    mask, w = torch.ones(1, 1, dtype=torch.bool), torch.ones(1)
    assert float(policy_loss(logp, old, torch.tensor([-1.0]), mask, w).loss) == pytest.approx(5.0)
    assert float(policy_loss(logp, old, torch.tensor([-1.0]), mask, w, clip_ratio_c=3.0).loss) == pytest.approx(3.0)


def test_kl_k3_hand_checked():
    # d = ref − logp = −0.5: exp(−0.5) + 0.5 − 1
    assert float(kl_k3(torch.tensor(-1.0), torch.tensor(-1.5))) == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-7)
    assert float(kl_k3(torch.tensor(-1.0), torch.tensor(-1.0))) == 0.0
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.tensor([[True, True]])
    out = policy_loss(logp, logp, torch.zeros(1), mask, torch.full((1,), 0.5), ref_logprobs=ref, kl_coef=0.1)
    kl = ((math.exp(-0.5) - 0.5) + (math.exp(1.0) - 1.0 - 1.0)) / 2
    assert out.metrics["actor/kl_loss"] == pytest.approx(kl, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * kl, abs=1e-6)  # A = 0: only the KL term
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, logp, torch.zeros(1), mask, torch.ones(1), kl_coef=0.1)


def test_metrics_and_per_token_advantages():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    logp = old + torch.log(torch.tensor([[1.5, 1.0, 0.5]]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = policy_loss(logp, old, torch.tensor([[1.0, 1.0, -1.0]]), mask, torch.full((1,), 1 / 3),
                      entropy=torch.tensor([[0.3, 0.6, 0.9]]))  # fmt: skip
    # token losses: −1.28 (clipped), −1.0, 0.8 (clipped)
    assert out.metrics["actor/pg_loss"] == pytest.approx((-1.28 - 1.0 + 0.8) / 3, abs=1e-6)
    assert out.metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    assert out.metrics["actor/ratio_max"] == pytest.approx(1.5)
    assert out.metrics["actor/ratio_min"] == pytest.approx(0.5)
    assert out.metrics["actor/entropy"] == pytest.approx(0.6)
    assert out.metrics["actor/ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3, abs=1e-6)
