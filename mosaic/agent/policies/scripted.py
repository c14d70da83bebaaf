"""A decode step's layers as one TorchScript call: fewer interpreter round trips, and no Python between them.

:class:`~mosaic.agent.policies.fastdecode.DecodeStep` runs about fifteen tensor operations per layer from
Python. For the small models this project trains on a CPU, each operation is a few microseconds of work
and about as much of Python and dispatch, and each one releases and retakes the interpreter lock.

:func:`decode_layers` is the same operations in the same order (RMSNorm, the joined q/k/v product, rotary
embedding, the write into the slab cache, grouped-query attention of the one query position, output
projection, RMSNorm, joined gate/up product, SiLU, down projection; final norm and head), compiled by
TorchScript: one call from Python per decode step, which holds no interpreter lock while it runs. The
results are bit-identical to :class:`DecodeStep`'s (tested). Measured with ``bench/rollout.py`` (its
``scripted/Python`` line, one thread): 6-9 % more sampled tokens per second at 4-8 rows, none at 32 (where
the products and the cache reads dominate). :func:`gather_rows`, :func:`row_copies` and :func:`join_slabs`
do the slab cache's copies of every layer in one call each, likewise.

It covers what the shipped models and their Llama/Qwen2 kin use: float32, one query position per row,
the slab cache, joined q/k/v and gate/up products (:data:`~mosaic.agent.policies.fastdecode.JOIN_MAX_ELEMENTS`),
SiLU itself, one RMSNorm epsilon, no bias but q/k/v's, on the CPU. Everything else (prefill blocks, other
dtypes, a larger model, a GPU) stays on :class:`DecodeStep`'s Python path; with
``LocalPolicyConfig(scripted_decode=False)`` (or ``fast_decode=False``) nothing is compiled at all.
TorchScript is deprecated in recent ``torch`` releases (it still works in the versions this package
supports); should compiling fail, or a compiled call fail (a fuser another library switched on), the
Python operations run from then on and one warning per function says so (tested).
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import List, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def decode_layers(ids: torch.Tensor, embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  keep: Optional[torch.Tensor], ln1: List[torch.Tensor], ln2: List[torch.Tensor], eps: float,
                  qkv_w: List[torch.Tensor], qkv_b: List[torch.Tensor], o_w: List[torch.Tensor],
                  gu_w: List[torch.Tensor], down_w: List[torch.Tensor], slab_k: List[torch.Tensor],
                  slab_v: List[torch.Tensor], length: int, hq: int, hk: int, head_dim: int, inner: int,
                  scale: float, norm_w: torch.Tensor, head_w: torch.Tensor) -> torch.Tensor:
    """One decode step: ``ids`` (B, 1) -> next-token logits (B, V); writes each layer's new key and value at
    position ``length`` of ``slab_k[i]`` / ``slab_v[i]`` (B, Hkv, capacity, D). ``cos``/``sin`` (B, 1, 1, D)
    are the rotary module's; ``keep`` None or (B, 1, 1, length + 1) bool; ``qkv_b`` empty when q/k/v have no
    bias. (TorchScript source: annotations are ``typing``'s, the body uses only what it compiles.)"""
    h = F.embedding(ids, embed)
    B = h.shape[0]
    D = head_dim
    half = D // 2
    end = length + 1
    for i in range(len(qkv_w)):
        x = h.to(torch.float32)
        y = ln1[i] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
        if len(qkv_b) > 0:
            x = F.linear(y, qkv_w[i], qkv_b[i])
        else:
            x = F.linear(y, qkv_w[i])
        x = x.view(B, 1, -1, D).transpose(1, 2)  # (B, Hq + 2 Hkv, 1, D)
        qk = x[:, :hq + hk]
        qk = (qk * cos) + (torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin)
        slab_k[i][:, :, length:end] = qk[:, hq:]
        slab_v[i][:, :, length:end] = x[:, hq + hk:]
        keys = slab_k[i][:, :, :end]
        values = slab_v[i][:, :, :end]
        hkv = keys.shape[1]
        s = torch.matmul(qk[:, :hq].reshape(B, hkv, hq // hkv, D) * scale, keys.transpose(-1, -2))
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s.float(), dim=-1).to(values.dtype)
        h = h + F.linear(torch.matmul(p, values).reshape(B, 1, hq * D), o_w[i])
        x = h.to(torch.float32)
        y = ln2[i] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
        gu = F.linear(y, gu_w[i])
        h = h + F.linear(F.silu(gu[..., :inner]) * gu[..., inner:], down_w[i])
    x = h.to(torch.float32)
    h = norm_w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return F.linear(h, head_w)[:, -1, :]


def gather_rows(slabs: List[torch.Tensor], indices: torch.Tensor, length: int) -> List[torch.Tensor]:
    """For each (B, H, capacity, D) buffer, a new one of the same capacity holding rows ``indices`` at positions
    ``:length`` (one row copy per kept row; the unwritten positions are not copied)."""
    out: List[torch.Tensor] = []
    for slab in slabs:
        o = torch.empty([indices.shape[0], slab.shape[1], slab.shape[2], slab.shape[3]], dtype=slab.dtype,
                        device=slab.device)
        torch.index_select(slab[:, :, :length], 0, indices, out=o[:, :, :length])
        out.append(o)
    return out


def row_copies(tensors: List[torch.Tensor], row: int, positions: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """Copies of batch row ``row`` of each (B, H, T, D) tensor: positions ``positions`` (along T), or all."""
    out: List[torch.Tensor] = []
    for t in tensors:
        out.append(t[row].clone() if positions is None else t[row].index_select(1, positions))
    return out


def join_slabs(a: List[torch.Tensor], b: List[torch.Tensor], keep: torch.Tensor, start: int, la: int, lb: int,
               room: int) -> List[torch.Tensor]:
    """:func:`~mosaic.agent.policies.kvcache.join_batches`' buffers: for each pair ``a[i]``, ``b[i]``, rows
    ``keep`` of ``a[i]``'s positions ``start:start + la`` then all of ``b[i]``'s ``:lb``, each right-aligned at
    ``L = max(la, lb)`` in a zeroed buffer of ``L + room`` positions."""
    out: List[torch.Tensor] = []
    n = keep.shape[0]
    L = max(la, lb)
    for i in range(len(a)):
        x, y = a[i], b[i]
        o = torch.zeros([n + y.shape[0], y.shape[1], L + room, y.shape[3]], dtype=y.dtype, device=y.device)
        if n > 0:
            torch.index_select(x[:, :, start:start + la], 0, keep, out=o[:n, :, L - la:L])
        o[n:, :, L - lb:L] = y[:, :, :lb]
        out.append(o)
    return out


class Compiled:
    """A function compiled by TorchScript, called like the function. Should a call fail (a fuser or an executor
    option another library switched on can fail at the first optimised run, after compiling went well), the
    function's own Python runs that call and every later one, and one warning says so. Every function here
    is safe to run again after a failed call: it writes only positions a retry writes again."""

    def __init__(self, fn, script) -> None:
        self.fn, self.script = fn, script

    def __call__(self, *args, **kwargs):
        script = self.script
        if script is not None:
            try:
                return script(*args, **kwargs)
            except Exception as exc:
                self.script = None
                log.warning("TorchScript's %s failed (%s: %s); running its Python operations from now on",
                            self.fn.__name__, type(exc).__name__, str(exc)[:200])
        return self.fn(*args, **kwargs)


_compiled: dict[str, Compiled] = {}
_lock = threading.Lock()


def compiled(fn) -> Compiled:
    """``fn`` compiled by TorchScript once per process (:class:`Compiled`); where it cannot be compiled, the
    function's Python runs (one warning per function says so)."""
    name = fn.__name__
    with _lock:
        if name not in _compiled:
            script = None
            try:
                with warnings.catch_warnings():  # (torch.jit.script's deprecation notice)
                    warnings.simplefilter("ignore")
                    script = torch.jit.script(fn)
            except Exception as exc:  # no TorchScript, no source files (a frozen app): the Python path
                log.warning("TorchScript could not compile %s (%s: %s); running its Python operations", name,
                            type(exc).__name__, str(exc)[:200])
            _compiled[name] = Compiled(fn, script)
        return _compiled[name]


def copies(fn, scripted: bool):
    """The slab cache's copy ``fn``: compiled when ``scripted``, else its Python."""
    return compiled(fn) if scripted else fn


def _plain_silu(act) -> bool:
    """``act`` is SiLU itself (torch's, or ``transformers``' own class), not a subclass with a forward of its own."""
    return type(act) is torch.nn.SiLU or (type(act).__name__ == "SiLUActivation"
                                          and type(act).__module__.startswith("transformers."))


class ScriptedDecode:
    """:func:`decode_layers` bound to one :class:`~mosaic.agent.policies.fastdecode.DecodeStep`'s weights;
    :meth:`build` says whether the step's model is one it covers."""

    def __init__(self, fn, step, layers, norm, head) -> None:
        self.fn = fn
        self.static = dict(
            ln1=[L.input_layernorm.weight for L in layers], ln2=[L.post_attention_layernorm.weight for L in layers],
            eps=float(layers[0].input_layernorm.variance_epsilon),
            qkv_w=[w for w, _ in step.qkv], qkv_b=[b for _, b in step.qkv if b is not None],
            o_w=[L.self_attn.o_proj.weight for L in layers], gu_w=[w for w, _ in step.gate_up],
            down_w=[L.mlp.down_proj.weight for L in layers], hq=step.split[0], hk=step.split[1],
            head_dim=step.head_dim, inner=step.inner, scale=float(step.scale), norm_w=norm.weight, head_w=head.weight)

    @classmethod
    def build(cls, step, layers, norm, head) -> "ScriptedDecode | None":
        """One for ``step`` when its model is covered (see the module's docstring)."""
        if step.qkv is None or step.gate_up is None or head.bias is not None:
            return None
        qkv_bias = {b is None for _, b in step.qkv}
        if len(qkv_bias) != 1 or any(b is not None for _, b in step.gate_up):
            return None
        norms = [n for L in layers for n in (L.input_layernorm, L.post_attention_layernorm)] + [norm]
        if len({float(n.variance_epsilon) for n in norms}) != 1:  # (one eps for every norm, as HF's configs have)
            return None
        for L in layers:
            if L.self_attn.o_proj.bias is not None or L.mlp.down_proj.bias is not None:
                return None
            if not _plain_silu(L.mlp.act_fn):
                return None
        if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in (head.weight, norm.weight, step.qkv[0][0])):
            return None
        fn = compiled(decode_layers)
        return None if fn.script is None else cls(fn, step, layers, norm, head)

    def __call__(self, input_ids: torch.Tensor, embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 keep: torch.Tensor | None, cache) -> torch.Tensor:
        layers = cache.layers
        length = layers[0].length
        logits = self.fn(input_ids, embed, cos, sin, keep, slab_k=[L.slab_k for L in layers],
                         slab_v=[L.slab_v for L in layers], length=length, **self.static)
        for L in layers:
            L.written(length + 1)
        return logits
