"""Tiny tokenizer + model fixtures for tests and benchmarks (no downloads, a few seconds on CPU).

Uses the project tokenizer (``mosaic.agent.tokenizer.train_tokenizer``) when that
module is present; otherwise trains a throwaway byte-level BPE with the same
ChatML specials (``<|im_end|>`` = eos / end of turn, ``<|endoftext|>`` = pad).
"""

from __future__ import annotations

import functools

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from mosaic.agent.models.embedded import EmbeddedModelConfig, build_model

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS_LINES = [
    "The capital of Velmora is Oranthi, a city on the river Sel.",
    "search(query) returns the top documents; delegate(question) forks a subagent.",
    "<answer>Oranthi</answer> ends the run. Summaries keep the facts found so far.",
    "Karlen Duvas founded Meridian Works in 1931 and studied at Tessaly University.",
    "The quick brown fox jumps over the lazy dog 0123456789 times, said the tool.",
    "user assistant system tool: {\"name\": \"search\", \"arguments\": {\"query\": \"x\"}}",
]


def corpus(n_repeat: int = 20) -> list[str]:
    """A small deterministic training corpus."""
    return [f"{line} ({i})" for i in range(n_repeat) for line in _CORPUS_LINES]


@functools.lru_cache(maxsize=4)
def tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A small ChatML tokenizer (cached; treat as read-only)."""
    try:
        from mosaic.agent.tokenizer import train_tokenizer  # type: ignore[import-not-found]
    except ImportError:
        tok = _throwaway_tokenizer(vocab_size)
    else:
        tok = train_tokenizer(corpus(), vocab_size)
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    return tok


def _throwaway_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None,
                                   additional_special_tokens=["<|im_start|>"])


def tiny_model(seed: int = 0, preset: str = "tiny", **overrides) -> tuple[PreTrainedModel,
                                                                           PreTrainedTokenizerFast]:
    """A freshly initialised embedded model over :func:`tiny_tokenizer`."""
    tok = tiny_tokenizer()
    return build_model(EmbeddedModelConfig.preset(preset, **overrides), tok, seed), tok
