"""CAPO (Harness-RL's conflict-aware policy optimisation), ``algo.capo=true``: docs/algorithm.md §5.1.

A turn's sampled tokens are of two types: the **action label** (which tool the turn calls, or that it
answers) and its **arguments** (everything else the turn samples). The first is a low-cardinality
decision, the second a long conditional sequence; one shared signal can pull them apart. CAPO routes the
policy gradient of each type to its own part of the parameters:

1. **Token types** (:func:`action_mask`): in a turn's text, the action span is ``<tool_call>`` through the
   closing quote of the ``"name"`` value (``<tool_call>{"name": "search"``), or the ``<answer>`` opening tag; a
   token is an action token when its characters overlap that span. A turn with neither (an invalid action)
   has argument tokens only.
2. **Partition** (:class:`ActivationMeter`, rule of ours: the paper names forward activations, not the
   statistic): for every ``nn.Linear`` inside the decoder layers and every output unit ``j``, the mean
   ``|activation|`` over the micro-batch's action positions, ``a_j``, and over its argument positions, ``b_j``
   (a token's position is the one whose logits predict it). Each is divided by its mean over the layer's
   units, so a token type with larger activations overall does not claim every unit; unit ``j`` (its weight
   row and bias) belongs to the action partition when ``a_j / mean(a) > b_j / mean(b)``, else to the
   arguments'. Every other parameter (embeddings, norms, the output layer) is shared.
3. **Routing** (:func:`routed_backward`): the loss splits exactly in two, ``L = L_action + L_args`` (the
   per-token weights restricted to each type; the loss is linear in them). Two backward passes give
   ``g_action`` and ``g_args``; a routed unit's rows take the gradient of its own type only, a shared
   parameter the sum (the plain gradient). With one partition (every unit shared) this is the plain loss.

Cost: a second backward pass per micro-batch, and two masked reductions per linear layer in the forward.
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Sequence

import torch

__all__ = ["action_span", "action_mask", "batch_action_mask", "piece_fn", "ActivationMeter", "positions",
           "meter_for", "routed_modules", "routed_grads", "routed_backward", "routed_loss"]

_CALL = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"[^"]*"')
_ANSWER = re.compile(r"<\s*answer\s*>", re.I)  # (any case and spacing, as the reward's extraction reads it)
_ANSWER_END = re.compile(r"<\s*/\s*answer\s*>", re.I)


def action_span(text: str) -> tuple[int, int] | None:
    """Character span of a turn's action label (see the module docstring), or None."""
    m_a = _ANSWER.search(text)
    a, c = (m_a.start() if m_a else -1), text.find("<tool_call>")
    if m_a and (_ANSWER_END.search(text, m_a.end()) or c < 0):  # a complete answer wins (tools.parse_action)
        return a, m_a.end()
    if c < 0:
        return None
    m = _CALL.match(text, c)
    return (c, m.end()) if m is not None else (c, c + len("<tool_call>"))


def piece_fn(tokenizer) -> Callable[[int], str]:
    """The text of one token id on its own (memoised): what :func:`action_mask` measures characters with."""
    return functools.lru_cache(maxsize=None)(lambda i: tokenizer.decode([i], skip_special_tokens=False))


def action_mask(ids: Sequence[int], piece: Callable[[int], str]) -> list[bool]:
    """For one turn's sampled ids: True where the token is part of the action label."""
    ends, n = [], 0
    for i in ids:
        n += len(piece(i))
        ends.append(n)
    span = action_span("".join(piece(i) for i in ids))
    if span is None:
        return [False] * len(ids)
    lo, hi = span
    return [(e - len(piece(i))) < hi and e > lo for i, e in zip(ids, ends)]


def batch_action_mask(completion_ids: torch.Tensor, loss_mask: torch.Tensor,
                      piece: Callable[[int], str]) -> torch.Tensor:  # fmt: skip
    """(R, Lc) bool: trained tokens that are action tokens (each run of trained tokens is one turn)."""
    out = torch.zeros_like(loss_mask, dtype=torch.bool)
    ids, mask = completion_ids.tolist(), loss_mask.tolist()
    for r in range(len(ids)):
        k = 0
        while k < len(mask[r]):
            if not mask[r][k]:
                k += 1
                continue
            e = k
            while e < len(mask[r]) and mask[r][e]:
                e += 1
            for j, v in enumerate(action_mask(ids[r][k:e], piece)):
                out[r, k + j] = v
            k = e
    return out


def routed_modules(model) -> list[tuple[str, torch.nn.Linear]]:
    """The linear layers whose units are partitioned: every ``nn.Linear`` inside the decoder's layers."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(dec, "layers", dec)
    return [(n, m) for n, m in layers.named_modules() if isinstance(m, torch.nn.Linear)]


class ActivationMeter:
    """Forward hooks that sum ``|output|`` per unit of every routed linear layer over the action positions
    and over the argument positions of one forward pass; :meth:`partitions` turns them into unit masks."""

    def __init__(self, model, action_pos: torch.Tensor, args_pos: torch.Tensor) -> None:
        self.mods = routed_modules(model)
        self.pos = (action_pos.to(torch.float32), args_pos.to(torch.float32))  # (R, Lmax) each
        self.sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles: list = []

    def __enter__(self) -> ActivationMeter:
        for name, m in self.mods:
            self._handles.append(m.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def fn(_mod, _inp, out):
            with torch.no_grad():
                a = out.detach().abs().float()
                self.sums[name] = tuple(torch.einsum("rl,rlu->u", p.to(a.device), a) for p in self.pos)
        return fn

    def partitions(self) -> dict[str, torch.Tensor]:
        """Per routed layer, (units,) bool: True = the action partition (module docstring, rule 2)."""
        n_a, n_b = (float(p.sum()) for p in self.pos)
        out = {}
        for name, (sa, sb) in self.sums.items():
            if n_a == 0 or n_b == 0:  # one type absent: its partition is empty
                out[name] = torch.full_like(sa, n_a > 0, dtype=torch.bool)
                continue
            a, b = sa / n_a, sb / n_b
            out[name] = a / a.mean().clamp_min(1e-12) > b / b.mean().clamp_min(1e-12)
        return out


def positions(batch, mask: torch.Tensor) -> torch.Tensor:
    """(R, Lmax) float: 1 at the positions whose logits predict the completion tokens where ``mask`` (R, Lc)."""
    r, lc = mask.shape
    pos = (batch.prompt_lens.unsqueeze(1) - 1 + torch.arange(lc, device=mask.device)).clamp(
        max=batch.input_ids.shape[1] - 1)  # fmt: skip
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=mask.device)
    out.scatter_add_(1, pos, mask.to(torch.float32))
    return out.clamp(max=1.0)


def meter_for(model, batch, piece: Callable[[int], str]) -> tuple[torch.Tensor, ActivationMeter]:
    """For one collated micro-batch: its action tokens ((R, Lc) bool, trained tokens only) and the meter to
    run its forward under (rules 1 and 2)."""
    act = batch_action_mask(batch.completion_ids.cpu(), batch.loss_mask.cpu(), piece).to(batch.loss_mask.device)
    act &= batch.loss_mask
    return act, ActivationMeter(model, positions(batch, act), positions(batch, batch.loss_mask & ~act))


def routed_grads(model, loss_action: torch.Tensor, loss_args: torch.Tensor,
                 parts: dict[str, torch.Tensor] | None) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, float]]:  # fmt: skip
    """The routed gradient (module docstring, rule 3) as (parameter, gradient) pairs, and metrics;
    ``parts`` None = one partition (every parameter shared: the plain gradient of ``loss_action + loss_args``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    ga = torch.autograd.grad(loss_action, params, retain_graph=True, allow_unused=True)
    gb = torch.autograd.grad(loss_args, params, allow_unused=True)
    rows: dict[int, torch.Tensor] = {}
    if parts is not None:
        for name, m in routed_modules(model):
            if name in parts:
                for p in (m.weight, m.bias):
                    if p is not None:
                        rows[id(p)] = parts[name]
    out = []
    for p, a, b in zip(params, ga, gb):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        unit = rows.get(id(p))
        if unit is None:
            out.append((p, a + b))
        else:
            keep = unit.to(p.device).view(-1, *([1] * (p.dim() - 1)))
            out.append((p, torch.where(keep, a, b)))
    units = list((parts or {}).values())
    return out, {"capo/action_units": float(sum(int(u.sum()) for u in units)),
                 "capo/units": float(sum(u.numel() for u in units))}


def routed_backward(model, loss_action: torch.Tensor, loss_args: torch.Tensor,
                    parts: dict[str, torch.Tensor] | None) -> dict[str, float]:  # fmt: skip
    """Accumulate the routed gradient (:func:`routed_grads`) into ``.grad``; returns metrics."""
    pairs, metrics = routed_grads(model, loss_action, loss_args, parts)
    for p, g in pairs:
        p.grad = g if p.grad is None else p.grad + g
    return metrics


def routed_loss(model, loss_action: torch.Tensor, loss_args: torch.Tensor,
                parts: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """For engines that run one ``backward`` over the loss they are given (TRL's training step, with its
    loss scaling, gradient accumulation and DDP all-reduce left in place): a tensor whose value is
    ``loss_action + loss_args`` and whose gradient is the routed gradient, ``sum_p <p, g_p>`` with ``g``
    detached, shifted to the loss's value. Returns it and metrics."""
    pairs, metrics = routed_grads(model, loss_action, loss_args, parts)
    lin = sum((p * g.detach()).sum() for p, g in pairs)
    return lin - lin.detach() + (loss_action + loss_args).detach(), metrics


def share_metrics(m: dict[str, float]) -> dict[str, float]:
    """The counts summed over micro-batches (``capo/action_units``, ``capo/units``, ``capo/action_tokens``,
    ``capo/trained_tokens``) as the two shares a step logs: ``capo/action_unit_share``,
    ``capo/action_token_share``."""
    units, tokens = m.pop("capo/units", 0.0), m.pop("capo/trained_tokens", 0.0)
    a_units, a_tokens = m.pop("capo/action_units", 0.0), m.pop("capo/action_tokens", 0.0)
    if units:
        m["capo/action_unit_share"] = a_units / units
    if tokens:
        m["capo/action_token_share"] = a_tokens / tokens
    return m
