"""Tiny tokenizer + model fixtures for the tests in this folder (no downloads, a few seconds on CPU).

The tokenizer is the project's (``mosaic.agent.tokenizer``: ChatML, ``<|im_end|>`` = eos /
end of turn, ``<|endoftext|>`` = pad) trained on a small fixed corpus.
"""

from __future__ import annotations

import functools

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from mosaic.agent.models.embedded import EmbeddedModelConfig, build_model
from mosaic.agent.tokenizer import train_tokenizer

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
    """The project tokenizer trained on :func:`corpus` (cached; treat as read-only)."""
    return train_tokenizer(corpus(), vocab_size)


def tiny_model(seed: int = 0, preset: str = "tiny", **overrides) -> tuple[PreTrainedModel,
                                                                           PreTrainedTokenizerFast]:
    """A freshly initialised embedded model over :func:`tiny_tokenizer`."""
    tok = tiny_tokenizer()
    return build_model(EmbeddedModelConfig.preset(preset, **overrides), tok, seed), tok
