"""Shared prefixes run once (mosaic.train.prefix_tree): the tree tiles every row, and its log-probs, entropies
and loss gradient equal one padded forward per row (float rounding aside)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mosaic.core.loss import policy_loss, token_weights
from mosaic.trace.rows import TrainingRow
from mosaic.train.batching import PackedRow, collate, completion_logprobs, micro_batches, pack_rows
from mosaic.train.prefix_tree import ACCEL_CALL_COST, Node, build_tree, level_batches, tree_logprobs

from .conftest import tiny_model


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=8))
def test_tree_paths_tile_each_sequence(seqs):
    nodes, paths = build_tree(seqs)
    for s, path in zip(seqs, paths):
        got, pos = [], 0
        for n in path:
            assert nodes[n].start == pos  # segments follow each other, parent before child
            assert nodes[n].parent == (path[path.index(n) - 1] if path.index(n) else -1)
            got += nodes[n].tokens
            pos = nodes[n].end
        assert got == list(s)
    # radix: a node is shared by every row through it, and no position is stored twice for one prefix
    seen = set()
    for s, path in zip(seqs, paths):
        for n in path:
            seen.add(tuple(s[: nodes[n].end]))
    assert len(seen) == len(nodes)
    distinct = {tuple(s[: k + 1]) for s in seqs for k in range(len(s))}
    assert sum(n.end - n.start for n in nodes) == len(distinct)


def _rows(seed: int, n_groups: int = 3, group: int = 4) -> list[TrainingRow]:
    """Groups of rollouts: one prompt per group, completions that share their first turns at random."""
    rng = random.Random(seed)
    rows = []
    for g in range(n_groups):
        prompt = [rng.randrange(4, 120) for _ in range(rng.randrange(6, 20))]
        first = [rng.randrange(4, 120) for _ in range(rng.randrange(2, 8))]
        for k in range(group):
            comp = (first if rng.random() < 0.6 else []) + [rng.randrange(4, 120) for _ in range(rng.randrange(1, 12))]
            mask = [rng.random() < 0.8 for _ in comp]
            mask[-1] = True
            lps = [-rng.random() if m else 0.0 for m in mask]
            t = g * group + k
            rows.append(TrainingRow(t, 0, "main", False, f"g{g}", prompt, comp, mask, lps, 0.0, rng.gauss(0, 1)))
            if rng.random() < 0.5:  # a later session of the same trajectory: same prompt head, another tail
                tail = [rng.randrange(4, 120) for _ in range(rng.randrange(1, 6))]
                c2 = [rng.randrange(4, 120) for _ in range(rng.randrange(1, 6))]
                rows.append(TrainingRow(t, 1, "main", False, f"g{g}", prompt + tail, c2, [True] * len(c2),
                                        [-0.5] * len(c2), 0.0, rng.gauss(0, 1)))  # fmt: skip
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tree_equals_padded_forward(seed, arch):
    model = tiny_model(vocab_size=128, seed=seed, arch=arch)
    packed = pack_rows(_rows(seed))
    b = collate(packed, range(len(packed)), pad_id=0)
    lp0, ent0 = completion_logprobs(model, b, temperature=0.7, with_entropy=True)
    lp1, ent1 = tree_logprobs(model, packed, temperature=0.7, with_entropy=True, max_batch_tokens=64)
    assert lp1.shape == lp0.shape
    torch.testing.assert_close(lp1, lp0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent1, ent0, rtol=1e-4, atol=1e-4)
    assert bool((lp1[~(torch.arange(lp1.shape[1])[None] < b.completion_lens[:, None])] == 0).all())


@pytest.mark.parametrize("mode", ["trajectory-token-mean", "token-mean"])
def test_tree_loss_gradient_equals_padded(mode):
    rows = _rows(7)
    packed = pack_rows(rows)
    model = tiny_model(vocab_size=128, seed=3)
    w_rows = token_weights([r.num_trainable for r in rows], [r.traj_index for r in rows], mode=mode)

    def loss_and_grad(tree: bool):
        model.zero_grad()
        total = 0.0
        for micro in micro_batches(packed, range(len(packed)), 5, by_prefix=tree):
            b = collate(packed, micro, pad_id=0)
            if tree:
                lp, _ = tree_logprobs(model, [packed[i] for i in micro])
            else:
                lp, _ = completion_logprobs(model, b)
            out = policy_loss(lp, b.old_logprobs, b.advantages, b.loss_mask, b.token_weights(w_rows))
            out.loss.backward()
            total += float(out.loss.detach())
        return total, [p.grad.clone() for p in model.parameters()]

    l0, g0 = loss_and_grad(False)
    l1, g1 = loss_and_grad(True)
    assert l1 == pytest.approx(l0, rel=1e-4, abs=1e-6)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)


def test_tree_runs_fewer_positions_than_the_rows_hold():
    packed = pack_rows(_rows(1, n_groups=2, group=8))
    nodes, _ = build_tree([p.input_ids for p in packed])
    assert sum(n.end - n.start for n in nodes) < 0.6 * sum(len(p.input_ids) for p in packed)


def test_rows_that_share_nothing_or_prefix_each_other():
    model = tiny_model(vocab_size=64, seed=1)
    rows = [PackedRow([5, 6], [7, 8], [True, True], [-1.0, -1.0], [1.0, 1.0], [0, 0], 0),
            PackedRow([9], [10, 11, 12], [True, False, True], [-1.0, 0.0, -1.0], [1.0] * 3, [1, -1, 1], 1),
            PackedRow([5, 6, 7], [8], [True], [-1.0], [1.0], [2], 2),  # a prefix of row 0's ids
            PackedRow([5, 6], [7, 8, 3], [True, True, True], [-1.0] * 3, [1.0] * 3, [3] * 3, 3)]  # fmt: skip
    b = collate(rows, range(4), pad_id=0)
    lp0, _ = completion_logprobs(model, b)
    lp1, _ = tree_logprobs(model, rows)
    torch.testing.assert_close(lp1, lp0, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="without prompt"):
        tree_logprobs(model, [PackedRow([], [1], [True], [-1.0], [1.0], [0], 0)])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 900), st.integers(1, 600)), min_size=1, max_size=24),
       st.integers(64, 4096))
def test_level_batches_cover_each_node_once_within_the_budget(spans, max_tokens):
    nodes = [Node(p, p + s, -1, 0, []) for p, s in spans]
    batches = level_batches(list(range(len(nodes))), nodes, max_tokens)
    assert sorted(n for b in batches for n in b) == list(range(len(nodes)))
    for b in batches:
        padded = len(b) * (max(nodes[n].start for n in b) + max(nodes[n].end - nodes[n].start for n in b))
        assert len(b) == 1 or padded <= max_tokens


def test_one_long_node_is_not_batched_with_short_ones():
    # a 558-position segment among short ones: one batch would pad the short ones to it (the case measured)
    nodes = [Node(249, 249 + s, -1, 2, []) for s in (155, 558)] + [Node(280, 280 + s, -1, 2, []) for s in (12, 68)]
    batches = level_batches(list(range(4)), nodes, 16384)
    assert [1] in batches and all(len(b) < 4 for b in batches)
    # where a call costs far more than a padded position (an accelerator), they stay in one forward
    assert [sorted(b) for b in level_batches(list(range(4)), nodes, 16384, call_cost=ACCEL_CALL_COST)] == [[0, 1, 2, 3]]
    # equal nodes share one forward (a call costs more than padding nothing)
    same = [Node(300, 360, -1, 1, []) for _ in range(6)]
    assert level_batches(list(range(6)), same, 16384) == [list(range(6))]
