"""The TorchScript decode step and cache copies (``mosaic.agent.policies.scripted``) give the Python path's
values bit for bit, and the decode falls back to Python where TorchScript cannot compile."""

from __future__ import annotations

import logging

import pytest
import torch

from _tiny import tiny_model
from mosaic.agent.policies import fastdecode, scripted
from mosaic.agent.policies.fastdecode import decode_step_for
from mosaic.agent.policies.kvcache import SlabCache
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.agent.policy import GenRequest


@pytest.fixture(scope="module")
def model_tok():
    return tiny_model(seed=5, initializer_range=0.3)


def _prefilled(model, B: int, T0: int, room: int) -> SlabCache:
    g = torch.Generator().manual_seed(2)
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    cache = SlabCache(cfg.num_hidden_layers, T0 + room)
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(B, hkv, 1, d), torch.zeros(B, hkv, 1, d))
        layer.slab_k[:, :, :T0] = torch.randn(B, hkv, T0, d, generator=g)
        layer.slab_v[:, :, :T0] = torch.randn(B, hkv, T0, d, generator=g)
        layer.written(T0)
    return cache


@pytest.mark.parametrize("padded", [True, False])
def test_scripted_decode_steps_are_bit_identical_to_the_python_steps(model_tok, padded):
    model = model_tok[0]
    fast, slow = decode_step_for(model), decode_step_for(model, scripted=False)
    assert fast.scripted is not None and slow.scripted is None
    B, T0, n = 4, 9, 12
    caches = [_prefilled(model, B, T0, n), _prefilled(model, B, T0, n)]
    mask = torch.ones(B, T0 + n, dtype=torch.long)
    if padded:
        mask[1, :4] = 0
        mask[3, :1] = 0
    g = torch.Generator().manual_seed(4)
    pos = torch.full((B, 1), T0)
    with torch.inference_mode():
        for t in range(n):
            tok = torch.randint(3, model.config.vocab_size, (B, 1), generator=g)
            a = fast(tok, mask[:, :T0 + t + 1], pos + t, caches[0])
            b = slow(tok, mask[:, :T0 + t + 1], pos + t, caches[1])
            assert torch.equal(a, b)
    for x, y in zip(*(c.layers for c in caches)):
        assert x.length == y.length == T0 + n
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


def test_a_full_slab_takes_the_python_path_that_grows_it(model_tok):
    model = model_tok[0]
    step = decode_step_for(model)
    cache = _prefilled(model, 2, 5, 0)  # no room left: the scripted path would write past the buffer
    assert not fastdecode._scriptable(torch.zeros(2, 1, dtype=torch.long), cache)
    with torch.inference_mode():
        step(torch.tensor([[5], [6]]), torch.ones(2, 6, dtype=torch.long), torch.full((2, 1), 5), cache)
    assert cache.layers[0].length == 6 and cache.layers[0].capacity >= 6


def test_scripted_cache_copies_equal_their_python_operations():
    g = torch.Generator().manual_seed(0)
    slabs = [torch.randn(5, 2, 11, 4, generator=g) for _ in range(6)]
    keep = torch.tensor([0, 3, 4])
    for fn, args in ((scripted.gather_rows, (slabs, keep, 8)),
                     (scripted.row_copies, ([s[:, :, :8] for s in slabs], 3, torch.tensor([1, 2, 5]))),
                     (scripted.row_copies, ([s[:, :, :8] for s in slabs], 1, None)),
                     (scripted.join_slabs, (slabs, slabs[:3] + slabs[:3], keep, 2, 6, 9, 3)),
                     (scripted.join_slabs, (slabs, slabs, keep[:0], 0, 0, 9, 1))):
        compiled = scripted.compiled(fn)
        assert compiled is not None
        want, got = fn(*args), compiled(*args)
        assert len(want) == len(got) and len(want) == len(args[0])
        for w, x in zip(want, got):
            if fn is scripted.gather_rows:  # (only the written positions are defined)
                w, x = w[:, :, :args[2]], x[:, :, :args[2]]
            assert torch.equal(w, x)


def _requests(tok, n: int = 10) -> list[GenRequest]:
    words = "who founded Meridian Works and when did the Velmora bridge open to traffic".split()
    return [GenRequest(f"r{i}", tok(" ".join(words[: 3 + i % 9] * (1 + i % 3)), add_special_tokens=False)["input_ids"],
                       5 + 3 * (i % 4)) for i in range(n)]


@pytest.mark.parametrize("continuous", [True, False])
def test_generation_is_the_same_with_and_without_scripting(model_tok, continuous):
    """Whole calls: rows finishing, being gathered and (continuous batching) joining a running batch."""
    model, tok = model_tok

    def run(on: bool):
        pol = LocalPolicy(model, tok, LocalPolicyConfig(temperature=1.0, seed=7, max_batch_size=4, stop_token_ids=(-1,),
                                                         continuous_batching=continuous, scripted_decode=on))
        return pol.generate(_requests(tok))

    a, b = run(True), run(False)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]


def _generate(model, tok, **kw) -> list:
    cfg = LocalPolicyConfig(temperature=1.0, seed=3, continuous_batching=True, max_batch_size=3, **kw)
    return [(r.token_ids, r.logprobs) for r in LocalPolicy(model, tok, cfg).generate(_requests(tok))]


def test_without_torchscript_the_decode_runs_its_python_operations(model_tok, monkeypatch, caplog):
    model, tok = model_tok
    want = _generate(model, tok)

    def no_script(fn):
        raise RuntimeError("TorchScript is gone")

    monkeypatch.setattr(scripted, "_compiled", {})
    monkeypatch.setattr(torch.jit, "script", no_script)
    with caplog.at_level(logging.WARNING, logger="mosaic.agent.policies.scripted"):
        assert decode_step_for(model).scripted is None
        assert _generate(model, tok) == want
    warned = [r.getMessage() for r in caplog.records if "TorchScript" in r.getMessage()]
    assert len(warned) == len(set(warned)) >= 2  # once per function: the decode step, the cache copies
    assert any("decode_layers" in w for w in warned)


def test_a_compiled_call_that_fails_runs_python_from_then_on(model_tok, monkeypatch, caplog):
    """Compiling went well but running fails (a fuser another library switched on fails at the first optimised
    run): that call and every later one run the Python operations, the same values, one warning each."""
    model, tok = model_tok
    want = _generate(model, tok)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Schema not found for node")

    monkeypatch.setattr(scripted, "_compiled", {})
    monkeypatch.setattr(torch.jit, "script", lambda fn: broken)
    with caplog.at_level(logging.WARNING, logger="mosaic.agent.policies.scripted"):
        assert decode_step_for(model).scripted is not None
        assert _generate(model, tok) == want
        n = len(calls)
        assert _generate(model, tok) == want
    assert len(calls) == n  # not tried again
    warned = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(warned) == len(set(warned)) and any("decode_layers" in w for w in warned)


def test_a_cpu_fuser_switched_on_elsewhere_does_not_break_the_decode(model_tok, monkeypatch):
    """``torch.jit.enable_onednn_fusion(True)``, set by another library, made the first optimised run fail
    (found by a review); whatever this torch does with it, the tokens are the unfused ones."""
    model, tok = model_tok
    want = _generate(model, tok)
    monkeypatch.setattr(scripted, "_compiled", {})
    torch.jit.enable_onednn_fusion(True)
    try:
        got = _generate(model, tok)
    finally:
        torch.jit.enable_onednn_fusion(False)
    assert got == want


@pytest.mark.parametrize("off", [{"scripted_decode": False}, {"fast_decode": False}])
def test_switched_off_nothing_is_compiled(model_tok, monkeypatch, off):
    model, tok = model_tok
    want = _generate(model, tok, **off)  # (fast_decode=False: the model's own forward, other float rounding)
    seen = []
    monkeypatch.setattr(scripted, "_compiled", {})
    monkeypatch.setattr(torch.jit, "script", lambda fn: seen.append(fn.__name__))
    assert _generate(model, tok, **off) == want
    assert seen == []


def test_models_the_scripted_step_does_not_reproduce_keep_the_python_step(model_tok):
    model = tiny_model(seed=5, initializer_range=0.3)[0]
    assert decode_step_for(model).scripted is not None

    class ScaledSiLU(torch.nn.SiLU):
        def forward(self, x):
            return 1.5 * torch.nn.functional.silu(x)

    act = model.model.layers[1].mlp.act_fn
    model.model.layers[1].mlp.act_fn = ScaledSiLU()
    assert decode_step_for(model).scripted is None
    model.model.layers[1].mlp.act_fn = act
    model.model.norm.variance_epsilon = 1e-2  # one norm's epsilon unlike the others'
    assert decode_step_for(model).scripted is None
