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
                                                             slab_cache=slab)), tok)
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
