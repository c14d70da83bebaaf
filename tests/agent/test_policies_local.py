"""LocalPolicy: batched KV-cache decoding equals unbatched and HF generate; log-probs; stops."""

from __future__ import annotations

import pytest
import torch

from _tiny import tiny_model
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig, sample_next
import mosaic.agent.policies.local as local_mod
from mosaic.agent.policies.prefill import prefill
from mosaic.agent.policy import GenRequest, Policy

TEXTS = [
    "The capital of Velmora is",
    "search(query) returns the top documents; delegate(question) forks a subagent and",
    "Karlen",
    "<|im_start|>user\nWho founded Meridian Works?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog 0123",
]


@pytest.fixture(scope="module")
def model_tok():
    # A larger init than training uses: peaked logits, so greedy argmax has no near-ties
    # that batched vs unbatched fp32 rounding could flip.
    return tiny_model(seed=3, initializer_range=0.3)


@pytest.fixture(scope="module")
def prompts(model_tok):
    _, tok = model_tok
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def _reqs(prompts, max_new=16):
    news = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    return [GenRequest(f"s{i}", p, n) for i, (p, n) in enumerate(zip(prompts, news))]


def test_is_a_policy(model_tok):
    assert isinstance(LocalPolicy(*model_tok), Policy)


def test_greedy_batched_equals_unbatched_and_hf_generate(model_tok, prompts):
    model, tok = model_tok
    pol = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0, prefix_cache=False))
    reqs = _reqs(prompts, [16, 5, 16, 9, 12])
    batched = pol.generate(reqs)
    assert len({len(p) for p in prompts}) > 1
    for req, res in zip(reqs, batched):
        alone = pol.generate([req])[0]
        assert res.token_ids == alone.token_ids
        assert res.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        hf = model.generate(torch.tensor([req.prompt_ids]), attention_mask=torch.ones(1, len(req.prompt_ids), dtype=torch.long),
                            max_new_tokens=req.max_new_tokens, do_sample=False,
                            eos_token_id=list(pol.stop_ids), pad_token_id=pol.pad_id)
        assert res.token_ids == hf[0, len(req.prompt_ids):].tolist()
        assert len(res.token_ids) == len(res.logprobs) == len(res.raw_logprobs)
        assert res.finish_reason == ("stop" if res.token_ids[-1] in pol.stop_ids else "length")


def test_stop_on_end_of_turn_mid_batch(model_tok, prompts):
    """Rows that stop early are dropped from the batch; the others are unaffected."""
    model, tok = model_tok
    free = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0)).generate(_reqs(prompts))
    stop_tok = free[0].token_ids[3]  # row 0 stops at step 4 at the latest
    pol = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0, stop_token_ids=(stop_tok,)))
    out = pol.generate(_reqs(prompts))
    stopped = 0
    for f, o in zip(free, out):
        if stop_tok in f.token_ids:
            cut = f.token_ids.index(stop_tok) + 1
            assert o.token_ids == f.token_ids[:cut] and o.finish_reason == "stop"
            stopped += 1
        else:
            assert o.token_ids == f.token_ids and o.finish_reason == "length"
    assert 1 <= stopped < len(prompts)  # the drop path ran and other rows went on
    assert out[0].finish_reason == "stop" and len(out[0].token_ids) <= 4


def test_default_stop_ids_include_im_end(model_tok):
    model, tok = model_tok
    assert tok.convert_tokens_to_ids("<|im_end|>") in LocalPolicy(model, tok).stop_ids


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_logprobs_equal_fresh_forward(model_tok, prompts, top_p):
    model, tok = model_tok
    pol = LocalPolicy(model, tok, LocalPolicyConfig(temperature=1.0, top_p=top_p, seed=11))
    reqs = _reqs(prompts, 12)
    for req, res in zip(reqs, pol.generate(reqs)):
        ids = torch.tensor([req.prompt_ids + res.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # (T, V)
        n = len(req.prompt_ids)
        ref = [logp[n - 1 + k, t].item() for k, t in enumerate(res.token_ids)]
        assert res.raw_logprobs == pytest.approx(ref, abs=1e-4)
        if top_p == 1.0:
            assert res.logprobs == pytest.approx(ref, abs=1e-4)
        else:  # renormalised nucleus: never below the raw log-prob
            assert all(a >= b - 1e-5 for a, b in zip(res.logprobs, ref))


def test_seeded_sampling_is_reproducible(model_tok, prompts):
    model, tok = model_tok
    a = LocalPolicy(model, tok, LocalPolicyConfig(seed=5)).generate(_reqs(prompts))
    b = LocalPolicy(model, tok, LocalPolicyConfig(seed=5)).generate(_reqs(prompts))
    c = LocalPolicy(model, tok, LocalPolicyConfig(seed=6)).generate(_reqs(prompts))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_chunking_matches_one_batch(model_tok, prompts):
    model, tok = model_tok
    one = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0)).generate(_reqs(prompts))
    two = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0, max_batch_size=2)).generate(_reqs(prompts))
    assert [r.token_ids for r in one] == [r.token_ids for r in two]


def test_bad_requests_become_error_results(model_tok, prompts):
    model, tok = model_tok
    pol = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0))
    reqs = [GenRequest("a", [], 5), GenRequest("b", [10**9], 5), GenRequest("c", prompts[0], 0),
            GenRequest("d", prompts[0], 4)]
    out = pol.generate(reqs)
    assert [r.finish_reason for r in out[:3]] == ["error", "error", "length"]
    assert "empty" in out[0].error and "vocabulary" in out[1].error
    assert out[2].token_ids == []
    assert len(out[3].token_ids) == 4 or out[3].finish_reason == "stop"
    pol.release("d")  # no-op, must not raise


def test_sample_next_processing():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    tok, lp, raw = sample_next(logits, temperature=0, top_p=1.0, generator=g)
    assert tok.item() == 0 and lp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())
    # Tiny nucleus: only the top token survives, sampled with probability 1.
    tok, lp, raw = sample_next(logits, temperature=1.0, top_p=1e-6, generator=g)
    assert tok.item() == 0 and lp.item() == pytest.approx(0.0, abs=1e-6)
    # Temperature: log-prob under logits / T.
    tok, lp, raw = sample_next(logits, temperature=0.5, top_p=1.0, generator=g)
    assert lp.item() == pytest.approx(torch.log_softmax(logits / 0.5, -1)[0, tok.item()].item())
    assert raw.item() == pytest.approx(torch.log_softmax(logits, -1)[0, tok.item()].item())


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(max_batch_size=0)])
def test_config_validation(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LocalPolicyConfig(**bad)


def _next_turn(req, res, extra):
    return GenRequest(req.session_key, req.prompt_ids + res.token_ids + extra, req.max_new_tokens)


def test_prefix_cache_turns_equal_fresh_prefill(model_tok, prompts):
    """Three turns per session (tool tokens inserted between them), a new session joining
    mid-way and one whose context is rewritten: cached results equal a cache-free policy's."""
    model, tok = model_tok
    cached = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0))
    fresh = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0, prefix_cache=False))
    tool = tok("<|im_end|>\n<|im_start|>tool\nresult: Oranthi<|im_end|>\n<|im_start|>assistant\n",
               add_special_tokens=False)["input_ids"]
    reqs = _reqs(prompts[:3], [6, 3, 8])
    for turn in range(3):
        a, b = cached.generate(reqs), fresh.generate(reqs)
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
        reqs = [_next_turn(r, x, tool[: 3 + turn]) for r, x in zip(reqs, a)]
        if turn == 0:  # a new session, and a session whose context was rewritten
            reqs.append(GenRequest("new", prompts[3], 5))
            reqs[1] = GenRequest(reqs[1].session_key, prompts[4], 5)
    st = cached.cache_stats
    assert st["hits"] >= 5 and st["reused_tokens"] > st["prefilled_tokens"] / 2
    assert st["misses"] >= 4  # three first turns, the new session, the rewritten one


def test_prefix_cache_release_eviction_and_weight_change(model_tok, prompts):
    model, tok = model_tok
    pol = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0, prefix_cache_tokens=60))
    out = pol.generate(_reqs(prompts[:2], 4))
    assert set(pol._cache) <= {"s0", "s1"} and pol._cached_tokens <= 60
    pol.release("s0")
    pol.release("never-seen")
    assert "s0" not in pol._cache
    pol.generate(_reqs(prompts, 4))
    assert pol._cached_tokens <= 60 and pol.cache_stats["evictions"] >= 1
    with torch.no_grad():  # an optimizer step: in-place update -> every cached prefix is stale
        p = next(model.parameters())
        p.add_(0.0)
    nxt = [_next_turn(r, x, []) for r, x in zip(_reqs(prompts[:2], 4), out)]
    pol.generate(nxt)
    assert pol.cache_stats["invalidations"] == 1


def test_shared_prefix_cache_finds_the_longest_prefix_across_sessions(model_tok, prompts):
    """A server's requests carry no session: each turn comes under a new key with the whole context. The
    shared cache finds the previous turn's entry by content; results equal a cache-free policy's."""
    from mosaic.agent.policies.local import _common_prefix

    assert _common_prefix([1, 2, 3, 4], [1, 2, 9], 10) == 2 and _common_prefix([1, 2], [1, 2, 3], 1) == 1
    assert _common_prefix([5], [6], 3) == 0 and _common_prefix(list(range(50)), list(range(50)), 49) == 49
    model, tok = model_tok
    shared = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0, shared_prefix=True, shared_prefix_min=4))
    fresh = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0, prefix_cache=False))
    tool = tok("<|im_end|>\n<|im_start|>tool\nresult: Oranthi<|im_end|>\n<|im_start|>assistant\n",
               add_special_tokens=False)["input_ids"]
    reqs = [GenRequest(f"call-{i}", p, 6) for i, p in enumerate(prompts[1:4])]
    for turn in range(3):
        a, b = shared.generate(reqs), fresh.generate(reqs)
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
        reqs = [GenRequest(f"call-{turn}-{i}", r.prompt_ids + x.token_ids + tool, 6)
                for i, (r, x) in enumerate(zip(reqs, a))]  # a fresh key every call, like HTTP requests
    st = shared.cache_stats
    assert st["hits"] >= 6 and st["reused_tokens"] > st["prefilled_tokens"]
    assert shared._cached_tokens <= shared.config.prefix_cache_tokens


def test_identical_prompts_are_prefilled_once(model_tok, prompts):
    """G samples of one prompt share its prefill; each row still samples on its own (same results as
    prefilling every row, for the same generator state)."""
    model, tok = model_tok
    reqs = [GenRequest(f"g{k}", prompts[1], 8) for k in range(4)] + [GenRequest("other", prompts[0], 8)]
    a = LocalPolicy(model, tok, LocalPolicyConfig(temperature=1.0, seed=7, prefix_cache=False))
    out = a.generate(reqs)
    assert a.cache_stats["shared_prefill_rows"] == 3
    assert len({tuple(r.token_ids) for r in out[:4]}) > 1  # independent draws
    b = LocalPolicy(model, tok, LocalPolicyConfig(temperature=1.0, seed=7, prefix_cache=False))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(local_mod, "prefill_shared", prefill)  # every row prefilled
        ref = b.generate(reqs)
    assert b.cache_stats["shared_prefill_rows"] == 0
    for x, y in zip(out, ref):
        assert x.token_ids == y.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_identical_prompts_after_a_cached_prefix_are_prefilled_once(model_tok, prompts):
    """Rollouts that took the same action and got the same tool result send equal prompts whose start is
    cached: they are prefilled once too, with the same draws as prefilling each row after its prefix."""
    model, tok = model_tok
    tool = tok("<|im_end|>\n<|im_start|>tool\nresult: Oranthi<|im_end|>\n<|im_start|>assistant\n",
               add_special_tokens=False)["input_ids"]

    def run(share: bool):
        pol = LocalPolicy(model, tok, LocalPolicyConfig(temperature=1.0, seed=3, shared_prefix=True,
                                                         shared_prefix_min=4))
        first = pol.generate([GenRequest(f"s{k}", prompts[1], 5) for k in range(3)])
        nxt = prompts[1] + first[0].token_ids + tool  # every row goes on from row 0's turn
        with pytest.MonkeyPatch.context() as mp:
            if not share:
                mp.setattr(local_mod, "prefill_shared", prefill)
            before = dict(pol.cache_stats)
            out = pol.generate([GenRequest(f"t{k}", nxt, 6) for k in range(3)] + [GenRequest("o", prompts[0], 6)])
        st = {k: pol.cache_stats[k] - before.get(k, 0) for k in pol.cache_stats}
        return out, st

    out, st = run(True)
    ref, st_ref = run(False)
    assert st["shared_prefill_rows"] == 2 and st_ref["shared_prefill_rows"] == 0
    assert st["hits"] >= 3 and st["prefilled_tokens"] < st_ref["prefilled_tokens"]
    assert len({tuple(r.token_ids) for r in out[:3]}) > 1  # each row still draws on its own
    for x, y in zip(out, ref):
        assert x.token_ids == y.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
