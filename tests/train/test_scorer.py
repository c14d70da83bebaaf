import random

import pytest
import torch

from mosaic.trace import flatten
from mosaic.agent.chat import make_probe_fn
from mosaic.trace import turn_boundaries
from mosaic.train.probes import recompute_logprobs_reference
from mosaic.train.scorer import score_gains, score_reference, score_turns

from .conftest import tiny_model
from .trajs import compaction_chain, fork


@pytest.fixture(scope="module")
def probe(tokenizer):
    return make_probe_fn(tokenizer)


def _batch():
    rng = random.Random(0)
    return [
        compaction_chain(rng, 1, tid="a"),
        compaction_chain(rng, 3, tid="b", answer="Kelpin", reward=0.0),
        fork(rng, tid="c"),
        fork(rng, mode="own", tid="d"),
        compaction_chain(rng, 0, tid="e"),  # single session: final only
    ]


def test_probe_fn_locates_answer_tokens(tokenizer, probe):
    ids, (a, b) = probe("Velmora Quint")
    assert tokenizer.decode(ids[a:b]).strip() == "Velmora Quint"
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>assistant\n<answer>") and text.endswith("</answer><|im_end|>")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_cached_equals_reference(arch, probe):
    model = tiny_model(arch=arch, seed=1)
    trajs = _batch()
    fast = score_gains(trajs, model, probe)
    # Small budgets force several host batches and several padded probe batches.
    small = score_gains(trajs, model, probe, max_batch_tokens=300, max_batch_size=3)
    ref = score_reference(trajs, model, probe)
    fb = flatten(trajs)
    assert fast.gains.shape == (len(fb.kinds),)
    assert torch.equal(fast.is_final, torch.as_tensor(fb.is_final))
    live = ~fast.is_final
    torch.testing.assert_close(fast.loglik_before[live], ref.loglik_before[live], atol=1e-4, rtol=0)
    torch.testing.assert_close(fast.loglik_after[live], ref.loglik_after[live], atol=1e-4, rtol=0)
    torch.testing.assert_close(fast.gains, ref.gains, atol=1e-4, rtol=0)
    torch.testing.assert_close(small.gains, ref.gains, atol=1e-4, rtol=0)
    # The gains are not trivially zero (the test could not fail otherwise).
    assert float(fast.gains[live].abs().min()) > 1e-3
    assert fast.stats.num_probes == ref.stats.num_probes == fast.stats.num_unique_states
    assert fast.stats.tokens_encoded < ref.stats.tokens_encoded


def test_final_gain_zero_and_nan_loglik(model, probe):
    res = score_gains(_batch(), model, probe)
    assert torch.all(res.gains[res.is_final] == 0)
    assert torch.isnan(res.loglik_before[res.is_final]).all()
    assert torch.isfinite(res.gains).all()


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_compaction_chain_needs_2k_plus_1_probes(model, probe, k):
    t = compaction_chain(random.Random(k), k)
    for method in ("cached", "reference"):
        res = score_gains([t], model, probe, method=method)
        assert res.stats.num_state_refs == 4 * k  # 2k non-final sessions, 2 refs each
        assert res.stats.num_unique_states == 2 * k + 1
        assert res.stats.num_probes == 2 * k + 1


def test_shared_state_gives_consistent_loglik(model, probe):
    t = compaction_chain(random.Random(3), 2)
    res = score_gains([t], model, probe)
    # main0.after == comp1.before, comp1.after == main2.before, ...
    assert res.loglik_after[0] == res.loglik_before[1]
    assert res.loglik_after[1] == res.loglik_before[2]


def test_old_logprobs_from_the_same_pass(model, probe):
    trajs = _batch()
    res = score_gains(trajs, model, probe, return_logprobs=True, temperature=0.7, max_batch_tokens=500)
    sessions = [s for t in trajs for s in t.sessions]
    assert res.old_logprobs is not None and len(res.old_logprobs) == len(sessions)
    for s, lp in zip(sessions, res.old_logprobs):
        torch.testing.assert_close(lp, recompute_logprobs_reference(model, s, temperature=0.7), atol=1e-4, rtol=0)
    plain = score_gains(trajs, model, probe)
    torch.testing.assert_close(res.gains, plain.gains, atol=1e-5, rtol=0)


def test_turn_boundaries_and_turn_scores(model, probe):
    t = compaction_chain(random.Random(5), 1, turns=3)
    s0 = t.sessions[0]
    cuts = turn_boundaries(s0)
    assert cuts[0] == len(s0.prompt_ids) and cuts[-1] == len(s0.tokens()) and len(cuts) == 1 + 3
    m = s0.loss_mask
    for c in cuts[1:-1]:  # every inner boundary: an inserted token before, a sampled one after
        i = c - len(s0.prompt_ids)
        assert not m[i - 1] and m[i]
    ref = score_turns([t], model, probe, method="reference")
    fast = score_turns([t], model, probe, method="cached")
    for a, b in zip(ref.loglik, fast.loglik):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert ref.stats.num_probes == sum(len(turn_boundaries(s)) for s in t.sessions)
    # The session-level L at main0's prompt and end equal the turn-level ones.
    sess = score_gains([t], model, probe)
    assert abs(float(sess.loglik_before[0]) - float(ref.loglik[0][0])) < 1e-4
    assert abs(float(sess.loglik_after[0]) - float(ref.loglik[0][-1])) < 1e-4


def test_missing_ground_truth_fails_loud(model, probe):
    t = compaction_chain(random.Random(0), 1)
    t.ground_truth = None
    with pytest.raises(ValueError, match="ground_truth"):
        score_gains([t], model, probe)


def test_missing_states_fail_loud(model, probe):
    t = compaction_chain(random.Random(0), 1)
    t.sessions[1].state_after = None
    with pytest.raises(ValueError, match="state_after"):
        score_gains([t], model, probe)


def test_one_token_state_and_turn_cuts(model, probe):
    # An explicit one-token state: the probe runs with an empty cache prefix.
    t = fork(random.Random(7), mode="own", tid="x")
    t.states[0] = t.states[0][:1]
    fast = score_gains([t], model, probe)
    ref = score_reference([t], model, probe)
    torch.testing.assert_close(fast.gains, ref.gains, atol=1e-4, rtol=0)


def test_train_mode_is_restored_and_ignored(probe):
    m = tiny_model(seed=4)
    trajs = _batch()[:2]
    base = score_gains(trajs, m, probe)
    m.config.attention_dropout = 0.5  # would change L if scoring ran in train mode
    for mod in m.modules():
        if hasattr(mod, "attention_dropout"):
            mod.attention_dropout = 0.5
    m.train()
    again = score_gains(trajs, m, probe)
    assert m.training
    torch.testing.assert_close(again.gains, base.gains, atol=1e-5, rtol=0)


def test_permuting_trajectories_permutes_gains(model, probe):
    trajs = _batch()
    perm = [3, 0, 4, 2, 1]
    a = score_gains(trajs, model, probe, max_batch_tokens=400)
    b = score_gains([trajs[i] for i in perm], model, probe, max_batch_tokens=400)
    blocks, start = [], 0
    for t in trajs:
        blocks.append(a.gains[start : start + len(t.sessions)])
        start += len(t.sessions)
    torch.testing.assert_close(b.gains, torch.cat([blocks[i] for i in perm]), atol=1e-5, rtol=0)
    assert all(p.grad is None for p in model.parameters())
