"""Shared fixtures for tests/train: a tiny random causal LM and a tiny fast tokenizer."""

from __future__ import annotations

import pytest
import torch


def tiny_tokenizer():
    """A byte-level BPE (vocab ~400) with the chat special tokens, trained in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "<answer>Velmora Quint</answer> the capital of Ostrava is Kelpin",
        "search(query) returns documents about rivers, cities and people",
        "The answer is Brandor Lusk. assistant user system tool",
    ] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def tiny_model(vocab_size: int = 400, seed: int = 0, arch: str = "qwen2"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    if arch == "llama":
        m = LlamaForCausalLM(LlamaConfig(**kw))
    else:
        m = Qwen2ForCausalLM(Qwen2Config(**kw))
    # Random init has tiny weights -> near-uniform logits; scale up so log-probs differ across states.
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(8.0) if p.dim() > 1 else None
    return m.float().eval()


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def model():
    return tiny_model()


def save_tiny_base(tmp_path_factory, overrides: list[str]):
    """A random tiny embedded model + the project tokenizer, built from the CPU preset with ``overrides``
    (which name ``model.embedded_preset``) and saved as a model directory; returns ``(dir, cache_dir)``."""
    from mosaic.agent.models.embedded import save_model
    from mosaic.train import setup
    from mosaic.config.loader import load_config

    cfg = load_config("cpu", overrides=overrides + [f"data.cache_dir={tmp_path_factory.mktemp('cache')}"])
    model, tok = setup.build_base_model(cfg, torch.device("cpu"), torch.float32)
    d = tmp_path_factory.mktemp("base")
    save_model(model, tok, d)
    return d, cfg.data.cache_dir
