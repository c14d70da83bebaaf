"""Training rows → padded tensors, and the per-token log-probs of a policy on them.

A row is one session (docs/algorithm.md §5): ``prompt_ids`` (never trained) followed by
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
class PackedRow:
    """One forward sequence carrying the trained tokens of one or more sessions of a trajectory.

    A main session's whole context is the prefix of the compaction session that
    summarises it (docs/algorithm.md §2), so both train from one pass over the longer
    sequence: the logits of a prefix do not depend on what follows it. Fields
    mirror :class:`~mosaic.trace.rows.TrainingRow`; ``token_rows[k]`` is the index
    (into the unpacked rows) of the session completion token ``k`` belongs to,
    -1 where no session trains it, and ``token_advantages[k]`` that session's advantage.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    token_advantages: list[float]
    token_rows: list[int]
    traj_index: int

    @staticmethod
    def of(row: TrainingRow, index: int) -> "PackedRow":
        return PackedRow(list(row.prompt_ids), list(row.completion_ids), list(row.loss_mask), list(row.logprobs),
                         _advantages(row), [index if m else -1 for m in row.loss_mask], row.traj_index)  # fmt: skip

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def absorb(self, row: TrainingRow, index: int) -> bool:
        """Train ``row`` inside this sequence if its ids are a prefix of ours and its trained
        tokens fall on positions we do not train; returns whether it did."""
        ids = row.prompt_ids + row.completion_ids
        mine = self.input_ids
        if len(ids) > len(mine) or mine[: len(ids)] != ids or len(row.prompt_ids) < 1:
            return False
        shift = len(row.prompt_ids) - len(self.prompt_ids)  # row's completion offset in ours
        if shift < 0:  # its completion starts inside our prompt: move our prompt boundary back
            pad = -shift
            self.completion_ids = self.prompt_ids[-pad:] + self.completion_ids
            self.prompt_ids = self.prompt_ids[:-pad]
            self.loss_mask = [False] * pad + self.loss_mask
            self.logprobs = [0.0] * pad + self.logprobs
            self.token_advantages = [0.0] * pad + self.token_advantages
            self.token_rows = [-1] * pad + self.token_rows
            shift = 0
        span = range(shift, shift + len(row.completion_ids))
        if any(self.loss_mask[k] for k, m in zip(span, row.loss_mask) if m):
            return False  # both would train the same position: keep them apart
        for k, m, lp, a in zip(span, row.loss_mask, row.logprobs, _advantages(row)):
            if m:
                self.loss_mask[k], self.logprobs[k] = True, lp
                self.token_advantages[k], self.token_rows[k] = a, index
        return True


def _advantages(row: TrainingRow) -> list[float]:
    """Per-completion-token advantages of a row: its own list, else the session's scalar on every token."""
    if row.token_advantages is not None:
        return list(row.token_advantages)
    return [row.advantage] * len(row.completion_ids)


def pack_rows(rows: Sequence[TrainingRow], indices: Sequence[int] | None = None) -> list[PackedRow]:
    """Pack each row into a longer row of the same trajectory whose ids it prefixes (exact ids).

    Longest rows first; a row nobody can absorb becomes its own packed row. The
    trained tokens, their log-probs and advantages are unchanged, so the loss is
    the same — only fewer tokens go through the model (nor does any token after a row's last trained one).
    """
    indices = list(range(len(rows))) if indices is None else list(indices)
    by_traj: dict[int, list[int]] = {}
    for i in indices:
        by_traj.setdefault(rows[i].traj_index, []).append(i)
    out: list[PackedRow] = []
    for members in by_traj.values():
        members.sort(key=lambda i: -(len(rows[i].prompt_ids) + len(rows[i].completion_ids)))
        packed: list[PackedRow] = []
        for i in members:
            if not any(p.absorb(rows[i], i) for p in packed):
                packed.append(PackedRow.of(rows[i], i))
        out += packed
    return [trim(p) for p in out]


@dataclass
class RowBatch:
    """Right-padded tensors for R sequences.

    Attributes:
        input_ids: (R, Lmax) prompt + completion, padded with ``pad_id``.
        attention_mask: (R, Lmax) 1 on real tokens.
        completion_ids: (R, Lc) completion tokens, right-padded.
        loss_mask: (R, Lc) bool, True = trained token (False on padding).
        old_logprobs: (R, Lc) sampling log-probs (0 on padding).
        prompt_lens: (R,) prompt lengths; completion_lens: (R,).
        advantages: (R, Lc) per-token advantage (each token carries its session's).
        token_rows: (R, Lc) index of the unpacked row (session) each token trains, -1 if none.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_ids: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    prompt_lens: torch.Tensor
    completion_lens: torch.Tensor
    advantages: torch.Tensor
    token_rows: torch.Tensor

    def to(self, device) -> "RowBatch":
        return RowBatch(**{k: v.to(device) for k, v in self.__dict__.items()})

    def token_weights(self, row_weights: torch.Tensor) -> torch.Tensor:
        """(R, Lc) per-token weights from per-session weights ``row_weights`` (indexed by token_rows)."""
        w = row_weights.to(self.old_logprobs.device)[self.token_rows.clamp(min=0)]
        return torch.where(self.token_rows >= 0, w, torch.zeros_like(w))


def trim(r: PackedRow) -> PackedRow:
    """``r`` without the tokens after its last trained one (a tool response appended before a session ended,
    say): with causal attention they change no trained token's log-prob, so the forward skips them."""
    last = max((k for k, m in enumerate(r.loss_mask) if m), default=-1) + 1
    if last == len(r.completion_ids):
        return r
    return PackedRow(r.prompt_ids, r.completion_ids[:last], r.loss_mask[:last], r.logprobs[:last],
                     r.token_advantages[:last], r.token_rows[:last], r.traj_index)  # fmt: skip


def length_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into micro-batches by length (shortest first): each group padded to its own
    longest row holds at most ``max_tokens`` positions (a row longer than that goes alone), so short
    rows are not padded to the batch's longest one."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _trimmed(rows: Sequence[TrainingRow | PackedRow], i: int) -> PackedRow:
    """Row ``i`` as :func:`collate` lays it out: packed, its tokens up to the last trained one."""
    r = rows[i]
    return trim(r if isinstance(r, PackedRow) else PackedRow.of(r, i))


def row_lengths(rows: Sequence[TrainingRow | PackedRow]) -> list[int]:
    """The length :func:`collate` pads each row to (its tokens up to the last trained one)."""
    return [len(r.prompt_ids) + len(r.completion_ids) for r in (_trimmed(rows, i) for i in range(len(rows)))]


def collate(rows: Sequence[TrainingRow | PackedRow], indices: Sequence[int], *, pad_id: int) -> RowBatch:
    """Pad rows ``indices`` of ``rows`` (plain session rows or packed rows) into a :class:`RowBatch`."""
    sel = [_trimmed(rows, i) for i in indices]
    lmax = max(len(r.prompt_ids) + len(r.completion_ids) for r in sel)
    lc = max(max(len(r.completion_ids) for r in sel), 1)
    n = len(sel)
    input_ids = torch.full((n, lmax), pad_id, dtype=torch.long)
    attn = torch.zeros((n, lmax), dtype=torch.long)
    comp = torch.full((n, lc), pad_id, dtype=torch.long)
    mask = torch.zeros((n, lc), dtype=torch.bool)
    old = torch.zeros((n, lc), dtype=torch.float32)
    adv = torch.zeros((n, lc), dtype=torch.float32)
    trow = torch.full((n, lc), -1, dtype=torch.long)
    for j, r in enumerate(sel):
        ids = r.prompt_ids + r.completion_ids
        input_ids[j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attn[j, : len(ids)] = 1
        c = len(r.completion_ids)
        if c:
            comp[j, :c] = torch.tensor(r.completion_ids, dtype=torch.long)
            mask[j, :c] = torch.tensor(r.loss_mask, dtype=torch.bool)
            old[j, :c] = torch.tensor(r.logprobs, dtype=torch.float32)
            adv[j, :c] = torch.tensor(r.token_advantages, dtype=torch.float32)
            trow[j, :c] = torch.tensor(r.token_rows, dtype=torch.long)
    return RowBatch(
        input_ids=input_ids,
        attention_mask=attn,
        completion_ids=comp,
        loss_mask=mask,
        old_logprobs=old,
        prompt_lens=torch.tensor([len(r.prompt_ids) for r in sel], dtype=torch.long),
        completion_lens=torch.tensor([len(r.completion_ids) for r in sel], dtype=torch.long),
        advantages=adv,
        token_rows=trow,
    )


def plain_head(model):
    """The output layer when the logits are exactly ``head(decoder(...).last_hidden_state)`` (Llama, Qwen2/3,
    SmolLM2; not models that scale or soft-cap their logits); None otherwise (the full model is called)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "get_decoder") or not hasattr(model, "get_output_embeddings"):
        return None
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) or \
            getattr(cfg, "model_type", "") not in _PLAIN_HEAD_MODELS:  # fmt: skip
        return None
    return model.get_output_embeddings()


_PLAIN_HEAD_MODELS = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def completion_logprobs(
    model, batch: RowBatch, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (R, Lc) of each row's completion tokens under ``model`` (gradient flows).

    ``temperature`` divides the logits (use the sampling temperature so the PPO
    ratio compares like with like). Returns ``(logprobs, entropy or None)``;
    padding positions hold 0.
    """
    r, lc = batch.completion_ids.shape
    dev = batch.input_ids.device
    # Position of the logit that predicts completion token k: prompt_len - 1 + k.
    offs = torch.arange(lc, device=dev)
    pos = (batch.prompt_lens.unsqueeze(1) - 1 + offs).clamp(max=batch.input_ids.shape[1] - 1)  # (R, Lc)
    head = plain_head(model)
    # Right padding needs no mask: under causal attention no real token sees a later pad, and without a mask
    # the attention kernel skips the masked-out half (exactly the same log-probs; ~20 % less time on CPU).
    lens = batch.attention_mask.sum(1, keepdim=True)
    right = bool((batch.attention_mask == (torch.arange(batch.attention_mask.shape[1], device=dev) < lens)).all())
    mask = None if right else batch.attention_mask
    if head is not None:  # the output layer only where a completion token is predicted (not the prompt's rows)
        hid = model.get_decoder()(input_ids=batch.input_ids, attention_mask=mask,
                                  use_cache=False).last_hidden_state  # (R, Lmax, H)
        sel = head(hid.gather(1, pos.unsqueeze(-1).expand(r, lc, hid.shape[-1])))  # (R, Lc, V)
    else:
        logits = model(input_ids=batch.input_ids, attention_mask=mask, use_cache=False).logits
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


def micro_batches(rows: Sequence[TrainingRow | PackedRow], indices: Sequence[int], size: int, *,
                  by_prefix: bool = False) -> list[list[int]]:
    """Split ``indices`` into micro-batches of ``size`` rows, similar lengths together (less padding), or with
    ``by_prefix`` in the order of their ids (rows sharing a prefix together: :mod:`mosaic.train.prefix_tree`)."""
    if by_prefix:
        order = sorted(indices, key=lambda i: list(rows[i].prompt_ids) + list(rows[i].completion_ids))
    else:
        order = sorted(indices, key=lambda i: len(rows[i].prompt_ids) + len(rows[i].completion_ids))
    return [order[k : k + size] for k in range(0, len(order), size)]
