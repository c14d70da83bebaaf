"""Training rows → padded tensors, and the per-token log-probs of a policy on them.

A row is one session (SPEC §5): ``prompt_ids`` (never trained) followed by
``completion_ids`` with a boolean ``loss_mask`` (True = sampled by the policy).
The model reads ``prompt + completion`` once; the logits at position ``t``
predict token ``t + 1``, so the completion's log-probs come from positions
``len(prompt) - 1 … len(prompt) + len(completion) - 2``. Ids are copied from
the record as-is (token-in, token-out), never re-tokenised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from mosaic.trace.rows import TrainingRow


@dataclass
class RowBatch:
    """Right-padded tensors for R rows.

    Attributes:
        input_ids: (R, Lmax) prompt + completion, padded with ``pad_id``.
        attention_mask: (R, Lmax) 1 on real tokens.
        completion_ids: (R, Lc) completion tokens, right-padded.
        loss_mask: (R, Lc) bool, True = trained token (False on padding).
        old_logprobs: (R, Lc) sampling log-probs (0 on padding).
        prompt_lens: (R,) prompt lengths; completion_lens: (R,).
        advantages: (R,) per-row advantage; rows: indices of the rows in the full batch.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_ids: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    prompt_lens: torch.Tensor
    completion_lens: torch.Tensor
    advantages: torch.Tensor
    rows: torch.Tensor

    def to(self, device) -> "RowBatch":
        return RowBatch(**{k: v.to(device) for k, v in self.__dict__.items()})


def collate(rows: Sequence[TrainingRow], indices: Sequence[int], *, pad_id: int) -> RowBatch:
    """Pad rows ``indices`` of ``rows`` into a :class:`RowBatch`."""
    sel = [rows[i] for i in indices]
    lmax = max(len(r.prompt_ids) + len(r.completion_ids) for r in sel)
    lc = max(max(len(r.completion_ids) for r in sel), 1)
    n = len(sel)
    input_ids = torch.full((n, lmax), pad_id, dtype=torch.long)
    attn = torch.zeros((n, lmax), dtype=torch.long)
    comp = torch.full((n, lc), pad_id, dtype=torch.long)
    mask = torch.zeros((n, lc), dtype=torch.bool)
    old = torch.zeros((n, lc), dtype=torch.float32)
    for j, r in enumerate(sel):
        ids = r.prompt_ids + r.completion_ids
        input_ids[j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attn[j, : len(ids)] = 1
        c = len(r.completion_ids)
        if c:
            comp[j, :c] = torch.tensor(r.completion_ids, dtype=torch.long)
            mask[j, :c] = torch.tensor(r.loss_mask, dtype=torch.bool)
            old[j, :c] = torch.tensor(r.logprobs, dtype=torch.float32)
    return RowBatch(
        input_ids=input_ids,
        attention_mask=attn,
        completion_ids=comp,
        loss_mask=mask,
        old_logprobs=old,
        prompt_lens=torch.tensor([len(r.prompt_ids) for r in sel], dtype=torch.long),
        completion_lens=torch.tensor([len(r.completion_ids) for r in sel], dtype=torch.long),
        advantages=torch.tensor([r.advantage for r in sel], dtype=torch.float32),
        rows=torch.tensor(list(indices), dtype=torch.long),
    )


def completion_logprobs(
    model, batch: RowBatch, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (R, Lc) of each row's completion tokens under ``model`` (gradient flows).

    ``temperature`` divides the logits (use the sampling temperature so the PPO
    ratio compares like with like). Returns ``(logprobs, entropy or None)``;
    padding positions hold 0.
    """
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    logits = out.logits  # (R, Lmax, V)
    r, lc = batch.completion_ids.shape
    # Position of the logit that predicts completion token k: prompt_len - 1 + k.
    offs = torch.arange(lc, device=logits.device)
    pos = (batch.prompt_lens.unsqueeze(1) - 1 + offs).clamp(max=logits.shape[1] - 1)  # (R, Lc)
    sel = logits.gather(1, pos.unsqueeze(-1).expand(r, lc, logits.shape[-1]))  # (R, Lc, V)
    if temperature != 1.0:
        sel = sel / temperature
    logp_all = F.log_softmax(sel.float(), dim=-1)
    lp = logp_all.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)  # (R, Lc)
    valid = offs.unsqueeze(0) < batch.completion_lens.unsqueeze(1)
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
            ent = torch.where(valid, ent, torch.zeros_like(ent))
    return lp, ent


def micro_batches(rows: Sequence[TrainingRow], indices: Sequence[int], size: int) -> list[list[int]]:
    """Split ``indices`` into micro-batches of ``size`` rows, similar lengths together (less padding)."""
    order = sorted(indices, key=lambda i: len(rows[i].prompt_ids) + len(rows[i].completion_ids))
    return [order[k : k + size] for k in range(0, len(order), size)]
