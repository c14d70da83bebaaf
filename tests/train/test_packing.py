"""Packing a session into the longer session its ids prefix: same loss, same gradient, fewer tokens."""

from __future__ import annotations

import pytest
import torch

from mosaic.core.loss import policy_loss, token_weights
from mosaic.trace.rows import TrainingRow
from mosaic.train.batching import collate, completion_logprobs, pack_rows

from .conftest import tiny_model


def _row(traj, sess, prompt, completion, mask, adv, kind="main"):
    lps = [-0.1 * (k + 1) if m else 0.0 for k, m in enumerate(mask)]
    return TrainingRow(traj, sess, kind, False, f"g{traj}", prompt, completion, mask, lps, 0.0, adv)


def rows():
    # trajectory 0: main → compaction → main; the compaction's prompt is main 0's whole context + instruction
    m0 = _row(0, 0, [1, 2, 3], [10, 11, 90, 91, 12], [True, True, False, False, True], 0.5)
    c1 = _row(0, 1, [1, 2, 3, 10, 11, 90, 91, 12, 50, 51], [20, 21, 22], [True, True, True], -0.3, "compaction")
    m2 = _row(0, 2, [1, 2, 3, 20, 21], [30, 31, 92, 32], [True, True, False, True], 0.9)
    # trajectory 1: identical ids to trajectory 0's main, other trajectory: never packed across trajectories
    o0 = _row(1, 0, [1, 2, 3], [10, 11, 90, 91, 12], [True, True, False, False, True], -1.0)
    return [m0, c1, m2, o0]


def test_pack_keeps_every_trained_token_once():
    rs = rows()
    packed = pack_rows(rs)
    assert len(packed) == 3  # m0 went into c1
    assert sum(len(p.input_ids) for p in packed) < sum(len(r.input_ids) for r in rs)
    seen = {}
    for p in packed:
        for k, (m, row) in enumerate(zip(p.loss_mask, p.token_rows)):
            assert m == (row >= 0)
            if m:
                pos = len(p.prompt_ids) + k
                seen.setdefault(row, []).append((p.input_ids[pos], p.logprobs[k], p.token_advantages[k]))
    for i, r in enumerate(rs):
        want = [(t, lp, r.advantage) for t, lp, m in zip(r.completion_ids, r.logprobs, r.loss_mask) if m]
        assert seen[i] == want, i


def test_a_conflicting_row_is_not_packed():
    a = _row(0, 0, [1, 2], [5, 6], [True, True], 1.0)
    b = _row(0, 1, [1], [2, 5, 6, 7], [False, True, True, True], 1.0)  # trains a's tokens too
    assert len(pack_rows([a, b])) == 2


@pytest.mark.parametrize("mode", ["trajectory-token-mean", "token-mean", "session-token-mean"])
def test_packed_loss_and_gradient_equal_unpacked(mode):
    rs = rows()
    model = tiny_model(vocab_size=128)
    w_rows = token_weights([r.num_trainable for r in rs], [r.traj_index for r in rs], mode=mode)

    def loss_and_grad(seqs):
        model.zero_grad()
        b = collate(seqs, range(len(seqs)), pad_id=0)
        lp, _ = completion_logprobs(model, b)
        out = policy_loss(lp, b.old_logprobs, b.advantages, b.loss_mask, b.token_weights(w_rows))
        out.loss.backward()
        return float(out.loss.detach()), [p.grad.clone() for p in model.parameters()]

    l_plain, g_plain = loss_and_grad(rs)
    l_packed, g_packed = loss_and_grad(pack_rows(rs))
    assert l_packed == pytest.approx(l_plain, rel=1e-5, abs=1e-7)
    for a, b in zip(g_plain, g_packed):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
