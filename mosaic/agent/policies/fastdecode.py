"""One decode step, or one prefill block, of a Llama/Qwen2-family model without ``transformers``' per-call machinery.

A decode step feeds one token per row. Through ``model(...)`` it also pays, every step, for the output
capture decorators, the keyword plumbing of every module call, and the attention mask built from the 2-D
padding mask by ``create_causal_mask``; for a small model that is a large share of the step (about 40 % of
a batch-32 decode step of the shipped 4-layer model, measured with ``torch.profiler``).

:class:`DecodeStep` runs the same operations in the same order, straight on the model's own parameters and
rotary module: embedding, then per layer RMSNorm, q/k/v projections, rotary embedding, the cache update,
attention of the one query position over the cache, output projection and residual, RMSNorm and gated MLP
and residual; final norm and head. The attention is two batched matrix products and a softmax, grouped by
key/value head: each key/value head's queries (``num_heads / num_kv_heads`` of them) are multiplied by its
keys as they lie in the cache, where ``transformers``' sdpa path first copies every key and value
``num_heads / num_kv_heads`` times (``repeat_kv``) and then runs the fused kernel, whose per-call cost is
built for many query positions. For one query position the grouped products are 3-5x faster (batch 32,
300-1,000 cached positions, one thread: 1.2 vs 0.29 ms, 10.7 vs 2.2 ms) and agree with the kernel to
float rounding (~3e-7); padded positions get ``-inf`` before the softmax (the padding mask as a boolean
``(B, 1, 1, T)`` view, or none when nothing is padded). Tested against the model's own logits to 1e-4 (logits of order 10), and to give the
same sampled turns (``tests/agent/test_policies_local_slab.py``).

A prefill block (S new positions per row after the cache, as :func:`~mosaic.agent.policies.prefill.prefill_block`
lays rows out) runs the same layers; its attention is the fused kernel with grouped-query dispatch over the keys
and values where they lie (``transformers``' sdpa path copies them per query head first) under one boolean mask
built once per block (causal in the cache's layout, padded keys dropped), and only the last position reaches
the output layer. Tested against ``model(...)`` with and without a cache before the block, padded rows included.

:func:`decode_step_for` returns one only for a model it can reproduce: a ``Qwen2ForCausalLM`` or
``LlamaForCausalLM`` with plain ``nn.Linear`` projections, full attention everywhere, the ``sdpa``
attention, in eval mode, and no hooks on any module (hooks, e.g. a FLOP counter or an adapter, must see the
model's own forward); for any other model the caller keeps ``model(...)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from mosaic.agent.policies.kvcache import SlabCache, full_attention
from mosaic.agent.policies.scripted import ScriptedDecode

SUPPORTED = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


def _hooked(model: nn.Module) -> bool:
    """Any hook that must see the model's own forward: torch's module hooks, accelerate's (``_hf_hook``, a
    ``forward`` replaced on the instance, a device map), or a norm whose forward is not ``transformers``' own
    (a patched kernel)."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return True
    if getattr(model, "hf_device_map", None):
        return True
    for m in model.modules():
        if m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") or "forward" in m.__dict__:
            return True
        if type(m).__name__.endswith("RMSNorm") and not type(m).forward.__module__.startswith("transformers."):
            return True
    return False


def decode_step_for(model: nn.Module, *, scripted: bool = True) -> DecodeStep | None:
    """A :class:`DecodeStep` for ``model`` when it can reproduce ``model``'s forward (to float rounding), else None.
    It reads the weights as they are when it is built: build one per generate call. ``scripted``: decode steps
    run as one TorchScript call where :mod:`~mosaic.agent.policies.scripted` covers the model."""
    name = type(model).__name__
    cfg = getattr(model, "config", None)
    if SUPPORTED.get(name) != getattr(cfg, "model_type", None) or model.training:
        return None
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(cfg, "pretraining_tp", 1) != 1:
        return None
    if not full_attention(cfg):
        return None
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or len(layers) != cfg.num_hidden_layers or type(model.lm_head) is not nn.Linear:
        return None
    if type(inner.embed_tokens) is not nn.Embedding:
        return None
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        if any(type(p) is not nn.Linear for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                                    m.down_proj)):
            return None
    if _hooked(model):
        return None
    return DecodeStep(model, scripted=scripted)


JOIN_MAX_ELEMENTS = 16 * 2**20
"""Most q/k/v/gate/up weight elements for which :class:`DecodeStep` joins them into one product per layer (copies
made once per generate call; the shipped models have ~1M, SmolLM2-135M ~70M)."""


def _fusable(layer: nn.Module) -> tuple[nn.Linear, ...]:
    a, m = layer.self_attn, layer.mlp
    return a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj


def _joined(*mods: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights (and biases) of linear layers on the same input stacked into one: a single matrix product
    whose output columns are theirs, side by side (each column the same dot product as in its own layer)."""
    weight = torch.cat([m.weight for m in mods])
    biases = [m.bias for m in mods]
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat([b if b is not None else m.weight.new_zeros(m.out_features) for m, b in zip(mods, biases)])


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """``q`` (B, Hq, S, D) over the cache: ``keys``/``values`` (B, Hkv, T, D), ``keep`` None or (B, 1, S or 1, T),
    True on the positions attended to -> (B, S, Hq * D). Query head ``j`` reads key/value head ``j // (Hq / Hkv)``,
    as ``repeat_kv`` lays them out. Several query positions (a prefill), and half-precision models, take the
    fused kernel with grouped-query dispatch (no copied keys; a half-precision model's scores accumulate in
    fp32 there, the grouped products' would round to bf16); one fp32 query position the grouped products."""
    B, Hq, S, D = q.shape
    Hkv = keys.shape[1]
    if S > 1 and q.device.type != "cpu":  # (a masked grouped-query call falls back to the math kernel on GPUs)
        keys, values = keys.repeat_interleave(Hq // Hkv, dim=1), values.repeat_interleave(Hq // Hkv, dim=1)
    if q.dtype != torch.float32 or S > 1:
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=keep, scale=scale,
                                           enable_gqa=keys.shape[1] != Hq)
        return o.transpose(1, 2).reshape(B, S, Hq * D)
    s = torch.matmul(q.reshape(B, Hkv, Hq // Hkv, D) * scale, keys.transpose(-1, -2))  # (B, Hkv, G, T)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(values.dtype)
    return torch.matmul(p, values).reshape(B, 1, Hq * D)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecodeStep:
    """``DecodeStep(model)(input_ids, attention_mask, position_ids, cache)`` -> next-token logits (B, V)."""

    def __init__(self, model: nn.Module, *, scripted: bool = True) -> None:
        inner = model.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        self.head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        # q, k, v as one product and gate, up as one: fewer calls per layer, which is most of a decode step's
        # cost for a small model at a few rows (1.95 vs 1.45 ms at 2 rows, shipped model), the same values.
        # Copies of the weights as they are now (so a step lives for one generate call), made only where they
        # are small: for a larger model the products themselves dominate and a copy would cost memory.
        self.split = (attn.q_proj.out_features // self.head_dim, attn.k_proj.out_features // self.head_dim)
        self.inner = self.layers[0].mlp.gate_proj.out_features
        self.qkv = self.gate_up = None
        if sum(m.weight.numel() for L in self.layers for m in _fusable(L)) <= JOIN_MAX_ELEMENTS:
            with torch.no_grad():
                self.qkv = [_joined(*_fusable(L)[:3]) for L in self.layers]
                self.gate_up = [_joined(*_fusable(L)[3:]) for L in self.layers]
        self.scripted = ScriptedDecode.build(self, self.layers, self.norm, self.head) if scripted else None

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache) -> torch.Tensor:
        """``input_ids`` and ``position_ids`` (B, S): one position per row (a decode step) or a block of S (a
        prefill: the new ids right-aligned after the cache's positions, pads masked); ``attention_mask`` (B, T):
        the cache's valid positions after this call's; ``cache``: the layers' keys/values (updated in place).
        Returns the last position's logits (B, V)."""
        (B, S), D = input_ids.shape, self.head_dim
        h = F.embedding(input_ids, self.embed.weight)  # (B, S, H)
        cos, sin = self.rotary(h, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        keep = _keep(attention_mask, S)
        if self.scripted is not None and _scriptable(input_ids, cache):  # the same operations, one call
            return self.scripted(input_ids, self.embed.weight, cos, sin, keep, cache)
        hq, hk = self.split
        for i, layer in enumerate(self.layers):
            a, m = layer.self_attn, layer.mlp
            y = _rms(h, layer.input_layernorm)
            if self.qkv is not None:
                x = F.linear(y, *self.qkv[i])
            else:
                x = torch.cat([F.linear(y, p.weight, p.bias) for p in (a.q_proj, a.k_proj, a.v_proj)], dim=-1)
            x = x.view(B, S, -1, D).transpose(1, 2)  # (B, Hq + 2 Hkv, S, D)
            qk = x[:, :hq + hk]
            qk = (qk * cos) + (_rotate_half(qk) * sin)  # q's and k's rotary in one pass (elementwise per head)
            keys, values = cache.update(qk[:, hq:], x[:, hq + hk:], i)
            o = _attend(qk[:, :hq], keys, values, keep, self.scale)
            h = h + F.linear(o, a.o_proj.weight, a.o_proj.bias)
            y = _rms(h, layer.post_attention_layernorm)
            if self.gate_up is not None:
                g, u = F.linear(y, *self.gate_up[i]).split(self.inner, dim=-1)
            else:
                g, u = F.linear(y, m.gate_proj.weight, m.gate_proj.bias), F.linear(y, m.up_proj.weight, m.up_proj.bias)
            h = h + F.linear(m.act_fn(g) * u, m.down_proj.weight, m.down_proj.bias)
        h = _rms(h[:, -1:], self.norm)  # only the last position's logits are read (logits_to_keep=1)
        return F.linear(h, self.head.weight, self.head.bias)[:, -1, :]


def _scriptable(input_ids: torch.Tensor, cache) -> bool:
    """The call can take the scripted step: one position per row into a slab cache with room for it."""
    if input_ids.shape[1] != 1 or not isinstance(cache, SlabCache):
        return False
    first = cache.layers[0]
    return first.is_initialized and first.length < first.capacity


def _keep(attention_mask: torch.Tensor, S: int) -> torch.Tensor | None:
    """The positions each of the last ``S`` positions attends to: (B, 1, S, T) bool, None when all of them
    see every position (a decode step with nothing padded). For ``S > 1`` it is causal in the cache's layout
    (the block's position ``i`` sees cache positions up to ``T - S + i``) and drops padded keys, as
    ``transformers``' own mask for a prefill after a cache; a padded query position with nothing to see
    gets zeros from the kernel and is never read."""
    if S == 1:
        return None if bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
    T = attention_mask.shape[1]
    causal = torch.ones((S, T), dtype=torch.bool, device=attention_mask.device).tril(T - S)
    return causal[None, None] & attention_mask.bool()[:, None, None, :]
