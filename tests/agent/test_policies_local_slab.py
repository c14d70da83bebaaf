"""The slab-cache decode (``mosaic.agent.policies.kvcache``) gives the growing cache's tokens.

Two references: HF's ``DynamicCache`` path kept behind ``LocalPolicyConfig(slab_cache=False)`` (same
tokens, same generator), and rollouts recorded at commit e59818e, before the slab cache existed
(``decode_record.py``: the shipped base model through the compaction harness)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import decode_record
from _tiny import tiny_model
from mosaic.agent.policies.kvcache import SlabCache, SlabLayer
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.agent.policy import GenRequest

RECORD = Path(__file__).parent / "data" / "decode_e59818e.json"


@pytest.fixture(scope="module")
def model_tok():
    return tiny_model(seed=3, initializer_range=0.3)


def _turns(pol: LocalPolicy, tok, n_turns: int = 3) -> list[list[int]]:
    """Three turns of five sessions (lengths, stops and max_new_tokens differ; two share a prompt)."""
    texts = ["The capital of Velmora is", "Karlen", "Karlen", "search(query) returns the top documents; and",
             "<|im_start|>user\nWho founded Meridian Works?<|im_end|>\n<|im_start|>assistant\n"]
    reqs = [GenRequest(f"s{i}", tok(t, add_special_tokens=False)["input_ids"], n)
            for i, (t, n) in enumerate(zip(texts, [12, 3, 9, 20, 7]))]
    tool = tok("<|im_end|>\n<|im_start|>tool\nresult<|im_end|>\n", add_special_tokens=False)["input_ids"]
    seen = []
    for _ in range(n_turns):
        out = pol.generate(reqs)
        seen += [r.token_ids for r in out]
        reqs = [GenRequest(r.session_key, r.prompt_ids + x.token_ids + tool, r.max_new_tokens)
                for r, x in zip(reqs, out)]
    return seen


@pytest.mark.parametrize("temperature,top_p,batch", [(1.0, 1.0, 64), (0.7, 0.9, 2), (0.0, 1.0, 3)])
def test_slab_equals_growing_cache(model_tok, temperature, top_p, batch):
    model, tok = model_tok
    stop = tuple(tok(" the", add_special_tokens=False)["input_ids"][:1]) + (tok.eos_token_id,)
    runs = [_turns(LocalPolicy(model, tok, LocalPolicyConfig(temperature=temperature, top_p=top_p, seed=5,
                                                             max_batch_size=batch, stop_token_ids=stop,
                                                             slab_cache=slab, continuous_batching=False)), tok)
            for slab in (True, False)]
    assert runs[0] == runs[1]
    assert len({len(t) for t in runs[0]}) > 2  # rows finished at different steps


def test_slab_layer_writes_in_place_and_grows():
    cache = SlabCache(num_layers=1, capacity=4)
    layer = cache.layers[0]
    assert isinstance(layer, SlabLayer)
    a, b = torch.randn(2, 1, 3, 2), torch.randn(2, 1, 3, 2)
    keys, _ = cache.update(a, a, 0)
    slab = layer.slab_k
    assert keys.data_ptr() == slab.data_ptr() and cache.get_seq_length() == 3
    keys, values = cache.update(b[:, :, :1], b[:, :, :1], 0)  # fits: no new buffer
    assert layer.slab_k is slab and torch.equal(keys, torch.cat([a, b[:, :, :1]], dim=2))
    keys, _ = cache.update(b, b, 0)  # past the capacity: grows once, keeps the values
    assert layer.capacity >= 7 and torch.equal(keys, torch.cat([a, b[:, :, :1], b], dim=2))
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(cache.layers[0].keys, torch.cat([a, b[:, :, :1], b], dim=2)[1:])


@pytest.mark.parametrize("case", range(len(decode_record.CASES)))
def test_rollouts_equal_the_recorded_growing_cache_decode(case):
    """The harness's trajectories (ids of every session) as the DynamicCache decode sampled them."""
    record = json.loads(RECORD.read_text())["cases"][case]
    assert record["params"] == list(decode_record.CASES[case])
    now = decode_record.rollouts(*decode_record.CASES[case])
    assert [t["id"] for t in now] == [t["id"] for t in record["trajectories"]]
    for a, b in zip(now, record["trajectories"]):
        assert [s["ids"] for s in a["sessions"]] == [s["ids"] for s in b["sessions"]]
        for x, y in zip(a["sessions"], b["sessions"]):
            assert x["logprobs"] == pytest.approx(y["logprobs"], abs=1e-4)


def _ragged_requests(tok, n: int = 12) -> list[GenRequest]:
    """Prompts of very different lengths (a grouped prefill pays off), two of them identical."""
    words = "search the archive for who founded Meridian Works and when the Velmora bridge opened".split()
    reqs = []
    for i in range(n):
        text = " ".join(words[: 2 + (7 * i) % len(words)] * (1 + i % 4))
        reqs.append(GenRequest(f"r{i}", tok(text, add_special_tokens=False)["input_ids"], 4 + i % 5))
    reqs[5] = GenRequest("r5", list(reqs[4].prompt_ids), 6)
    return reqs


@pytest.mark.parametrize("slab", [True, False])
def test_grouped_prefill_equals_one_padded_block(model_tok, slab):
    """Prefill in groups of similar rows, and the lean forward (``fast_decode``) of one block or of the groups:
    the same next-token logits and the same KV at every valid position as one left-padded block through
    ``model(...)``, cached prefixes of different lengths included (second turn)."""
    model, tok = model_tok
    pols = [LocalPolicy(model, tok, LocalPolicyConfig(temperature=0.0, prefill_group=g, prefill_pad_waste=0.0,
                                                      slab_cache=slab, fast_decode=fast))
            for g, fast in ((0, False), (4, False), (0, True), (4, True))]
    reqs = _ragged_requests(tok)
    tool = tok("<|im_end|>\nresult " * 3, add_special_tokens=False)["input_ids"]
    for turn in range(2):
        outs = []
        for pol in pols:
            prefixes = [pol._lookup(r) for r in reqs]
            with torch.inference_mode():
                logits, batch = pol._prefill(reqs, prefixes, room=3)
            valid = batch.mask[:, : batch.length].bool()
            kv = [(layer.keys.transpose(1, 2)[valid], layer.values.transpose(1, 2)[valid]) for layer in batch.cache.layers]
            for i, p in enumerate(prefixes):  # _lookup consumed the entries: put them back for the decode below
                if p is not None:
                    pol._store(reqs[i].session_key, p[0].ids, p[0].kv)
            outs.append((logits, batch.mask[:, : batch.length], kv))
        l0, m0, kv0 = outs[0]
        for l1, m1, kv1 in outs[1:]:
            assert torch.equal(m0, m1)
            torch.testing.assert_close(l1, l0, rtol=1e-4, atol=1e-4)
            for (k0, v0), (k1, v1) in zip(kv0, kv1):
                torch.testing.assert_close(k1, k0, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(v1, v0, rtol=1e-4, atol=1e-4)
        gen = [pol.generate(reqs) for pol in pols]
        assert all([r.token_ids for r in gen[0]] == [r.token_ids for r in other] for other in gen[1:])
        assert turn == 0 or pols[1].cache_stats["hits"] > 0
        reqs = [GenRequest(r.session_key, r.prompt_ids + x.token_ids + tool[: 2 + i % 5], r.max_new_tokens)
                for i, (r, x) in enumerate(zip(reqs, gen[0]))]
    assert pols[1].cache_stats["prefill_groups"] >= 6 and "prefill_groups" not in pols[0].cache_stats
    assert pols[3].cache_stats["prefill_groups"] >= 6


def _llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, attention_bias=True, mlp_bias=True,
                      initializer_range=0.2)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("padded", [True, False])
def test_fast_decode_step_gives_the_models_logits(model_tok, arch, padded):
    """:class:`DecodeStep` against ``model(...)``: the same logits to float rounding and the same cache, for a
    prefill block without and then with a cache before it (padded rows included), then step after step."""
    from mosaic.agent.policies.fastdecode import decode_step_for
    from mosaic.agent.policies.kvcache import SlabCache

    model = model_tok[0] if arch == "qwen2" else _llama()
    step = decode_step_for(model)
    assert step is not None
    B, T0, V = 5, 7, model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (B, T0), generator=g)
    mask = torch.ones(B, T0 + 4, dtype=torch.long)
    if padded:
        mask[1, :3] = 0
        mask[3, :1] = 0
        mask[2, 4:5] = 0  # a pad inside the second block ([pad][prefix][pad][suffix], as a prefill lays rows out)
    pos = (mask[:, :T0].cumsum(1) - 1).clamp(min=0)
    pre = [SlabCache(model.config.num_hidden_layers, T0) for _ in range(2)]
    caches = [SlabCache(model.config.num_hidden_layers, T0 + 4) for _ in range(2)]
    with torch.inference_mode():
        for a, b in ((0, 4), (4, T0)):  # a prefill block with no cache before it, then one after a cache
            ref = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b],
                        past_key_values=pre[0], use_cache=True).logits[:, -1, :]
            got = step(ids[:, a:b], mask[:, :b], pos[:, a:b], pre[1])
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
        valid = mask[:, :T0].bool()  # (a padded query position's own output is never read)
        for x, y in zip(pre[0].layers, pre[1].layers):
            for u, w in ((x.keys, y.keys), (x.values, y.values)):
                torch.testing.assert_close(w.transpose(1, 2)[valid], u.transpose(1, 2)[valid], rtol=1e-5, atol=1e-4)
        for c in caches:
            model(input_ids=ids, attention_mask=mask[:, :T0], position_ids=pos, past_key_values=c, use_cache=True)
        nxt = pos[:, -1:] + 1
        for t in range(4):
            tok = torch.randint(3, V, (B, 1), generator=g)
            ref = model(input_ids=tok, attention_mask=mask[:, :T0 + t + 1], position_ids=nxt,
                        past_key_values=caches[0], use_cache=True).logits[:, -1, :]
            got = step(tok, mask[:, :T0 + t + 1], nxt, caches[1])
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)  # (grouped products vs the fused kernel)
            nxt = nxt + 1
    for a, b in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-4)  # (layers >0 see the attention's rounding)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-4)


def test_fast_decode_only_for_models_it_reproduces(model_tok):
    from mosaic.agent.policies.fastdecode import decode_step_for

    model = model_tok[0]
    assert decode_step_for(model) is not None
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)  # a FLOP counter, an adapter...
    try:
        assert decode_step_for(model) is None
    finally:
        handle.remove()
    model.train()
    try:
        assert decode_step_for(model) is None
    finally:
        model.eval()
    assert decode_step_for(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_fast_decode_generates_the_same_turns(model_tok, temperature):
    model, tok = model_tok
    stop = tuple(tok(" the", add_special_tokens=False)["input_ids"][:1]) + (tok.eos_token_id,)
    runs = [_turns(LocalPolicy(model, tok, LocalPolicyConfig(temperature=temperature, seed=2, stop_token_ids=stop,
                                                             max_batch_size=4, fast_decode=fast)), tok)
            for fast in (True, False)]
    assert runs[0] == runs[1]


def test_full_attention_reads_every_sliding_window_convention():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from mosaic.agent.policies.kvcache import full_attention

    assert full_attention(LlamaConfig())
    assert full_attention(Qwen2Config(sliding_window=4096, use_sliding_window=False))
    assert not full_attention(MistralConfig(sliding_window=16))  # (no switch: a window set is used)
    assert full_attention(MistralConfig(sliding_window=None))


def test_fast_decode_off_under_accelerate_style_hooks(model_tok):
    """accelerate wraps ``forward`` on the instance (``_hf_hook``), not through torch's hook lists."""
    from mosaic.agent.policies.fastdecode import decode_step_for

    model = model_tok[0]
    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x, _f=mlp.forward: _f(x) * 0
    try:
        assert decode_step_for(model) is None
    finally:
        del mlp.forward
    assert decode_step_for(model) is not None
    model.hf_device_map = {"": "cpu"}
    try:
        assert decode_step_for(model) is None
    finally:
        del model.hf_device_map


def test_decode_attention_grouped_products_and_the_half_precision_kernel_agree():
    """fp32 takes the grouped products; bf16 the fused kernel (fp32 accumulation): both match a plain
    repeated-heads attention."""
    from mosaic.agent.policies.fastdecode import _attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((3, 4, 1, 32), (3, 2, 50, 32), (3, 2, 50, 32)))
    bias = torch.zeros(3, 1, 1, 50)
    bias[0, ..., :7] = float("-inf")
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = torch.softmax(q @ kk.transpose(-1, -2) * 32 ** -0.5 + bias, -1) @ vv  # (B, Hq, 1, D)
    ref = ref.transpose(1, 2).reshape(3, 1, 128)
    keep = bias == 0
    torch.testing.assert_close(_attend(q, k, v, keep, 32 ** -0.5), ref, rtol=1e-5, atol=1e-5)
    half = _attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), keep, 32 ** -0.5)
    torch.testing.assert_close(half.float(), ref, rtol=0, atol=2e-2)


def test_fast_step_reads_the_weights_of_each_generate_call(model_tok, monkeypatch):
    """The lean forward's joined projections are copies made per generate call: after weights change in place
    (an optimizer step), through ``.data`` or by ``vector_to_parameters`` (no version bump), the policy samples
    what ``model(...)`` gives; and without joined copies (a larger model) the same."""
    import copy

    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from mosaic.agent.policies import fastdecode

    model, tok = copy.deepcopy(model_tok[0]), model_tok[1]
    reqs = _ragged_requests(tok, 6)

    def agree() -> None:
        fast, slow = (LocalPolicy(model, tok, LocalPolicyConfig(temperature=0.0, fast_decode=f, prefix_cache=False))
                      for f in (True, False))
        assert fast.fast_step() is not None
        a, b = fast.generate(reqs), slow.generate(reqs)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        for x, y in zip(a, b):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)

    pol = LocalPolicy(model, tok, LocalPolicyConfig(temperature=0.0, prefix_cache=False))
    before = [r.token_ids for r in pol.generate(reqs)]
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(3.0)  # in place, as an optimizer step
    model.model.layers[1].mlp.up_proj.weight.data = model.model.layers[1].mlp.up_proj.weight.data * -2.0
    vector_to_parameters(parameters_to_vector(model.parameters()) * 1.5, model.parameters())
    assert [r.token_ids for r in pol.generate(reqs)] != before  # the same policy object sees the new weights
    agree()
    monkeypatch.setattr(fastdecode, "JOIN_MAX_ELEMENTS", 0)  # no joined copies: separate products
    assert fastdecode.decode_step_for(model).qkv is None
    agree()


def test_selected_rows_keep_their_positions_and_room_to_grow():
    cache = SlabCache(1, 8)
    a = torch.randn(3, 1, 5, 2)
    cache.update(a, a, 0)
    cache.batch_select_indices(torch.tensor([2, 0]))
    layer = cache.layers[0]
    assert layer.capacity == 8 and layer.slab_k.shape[:3] == (2, 1, 8)
    assert torch.equal(layer.keys, a[[2, 0]]) and torch.equal(layer.values, a[[2, 0]])
    b = torch.randn(2, 1, 3, 2)
    keys, _ = cache.update(b, b, 0)  # fills the room without a new buffer
    assert torch.equal(keys, torch.cat([a[[2, 0]], b], dim=2))
