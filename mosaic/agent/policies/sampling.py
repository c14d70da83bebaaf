"""Token sampling for :class:`~mosaic.agent.policies.local.LocalPolicy`: temperature, top-p, stop ids.

Log-probs returned by :func:`sample_next`: the log-probability of each sampled token under the
**processed distribution actually sampled from** (``log_softmax(logits / T)`` restricted to the
nucleus and renormalised), and the raw ``log_softmax(logits)`` of the same token. At ``T = 0`` the
sampler is greedy and both are the raw log-prob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Sampling:
    """One generate call's sampling settings."""

    temperature: float
    top_p: float
    stop: torch.Tensor  # (K,) end-of-turn ids
    generator: torch.Generator


def default_stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, ...]:
    """The model's eos id(s) plus ``<|im_end|>`` when the tokenizer has it."""
    ids: set[int] = set()
    for cfg in (model.generation_config, model.config):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
            ids.add(im_end)
    if not ids:
        raise ValueError("no end-of-turn id: pass LocalPolicyConfig(stop_token_ids=...)")
    return tuple(sorted(ids))


def sample_next(logits: torch.Tensor, *, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: (B, V) raw next-token logits.
    Returns:
        tokens (B,), sampling log-probs (B,) under the processed distribution,
        raw log-probs (B,) = ``log_softmax(logits)`` at the sampled tokens.
    """
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)  # (B, V)
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        raw_lp = raw.gather(1, tokens[:, None]).squeeze(1)
        return tokens, raw_lp, raw_lp
    logp = raw if temperature == 1 else torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_lp, order = logp.sort(dim=-1, descending=True)  # (B, V)
        cum = sorted_lp.exp().cumsum(dim=-1)
        # Drop a token when the mass *before* it already reaches top_p (the top one always stays).
        drop_sorted = (cum - sorted_lp.exp()) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    probs = logp.exp()
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
    return (tokens, logp.gather(1, tokens[:, None]).squeeze(1),
            raw.gather(1, tokens[:, None]).squeeze(1))


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit`` (binary search over slice
    comparisons, which run in C)."""
    hi = min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # a[:lo] == b[:lo] holds; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
