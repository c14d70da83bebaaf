"""Embedded model: presets, build determinism, save/load round trip (weights and tokenizer ids)."""

from __future__ import annotations

import json

import pytest
import torch

from mosaic.agent.models.embedded import (
    EmbeddedModelConfig,
    build_model,
    load_model,
    save_model,
)
from _tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("name,lo,hi", [("tiny", 1e6, 2e6), ("cpu", 3e6, 8e6)])
def test_preset_sizes_at_4k_vocab(name, lo, hi):
    assert lo <= EmbeddedModelConfig.preset(name).num_parameters(4096) <= hi


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tie", [True, False])
def test_build_matches_config(tok, arch, tie):
    cfg = EmbeddedModelConfig.preset("tiny", arch=arch, tie_embeddings=tie)
    model = build_model(cfg, tok, seed=0)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters(len(tok))


def test_build_is_deterministic_in_seed_and_keeps_global_rng(tok):
    cfg = EmbeddedModelConfig.preset("tiny")
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = build_model(cfg, tok, seed=7)
    after = torch.rand(3)
    b = build_model(cfg, tok, seed=7)
    c = build_model(cfg, tok, seed=8)
    assert torch.equal(before, after)  # caller's RNG stream untouched
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, pc)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_save_load_round_trip(tok, tmp_path, arch):
    model = build_model(EmbeddedModelConfig.preset("tiny", arch=arch), tok, seed=1)
    save_model(model, tok, tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    model2, tok2 = load_model(tmp_path)
    text = "<|im_start|>user\nWho founded Meridian Works?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok2(text, add_special_tokens=False)["input_ids"] == ids
    assert tok2.eos_token_id == tok.eos_token_id and tok2.pad_token_id == tok.pad_token_id
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model(x).logits, model2(x).logits)


def test_load_refuses_a_tokenizer_that_does_not_round_trip(tok, tmp_path):
    save_model(build_model(EmbeddedModelConfig.preset("tiny"), tok, seed=1), tok, tmp_path)
    check = tmp_path / "mosaic_tokenizer_check.json"
    data = json.loads(check.read_text())
    data["ids"] = data["ids"][::-1]
    check.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="does not reproduce"):
        load_model(tmp_path)


def test_load_missing_dir_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nope")


@pytest.mark.parametrize("bad,field", [(dict(num_heads=3), "num_heads"),
                                       (dict(num_kv_heads=3), "num_kv_heads"),
                                       (dict(arch="gpt2"), "arch"),
                                       (dict(num_layers=0), "num_layers")])
def test_config_validation_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EmbeddedModelConfig.preset("tiny", **bad)
