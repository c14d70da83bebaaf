"""KV storage of :class:`~mosaic.agent.policies.local.LocalPolicy`'s batched decode.

**Slab cache.** HF's ``DynamicCache`` grows every layer's keys and values by one position per decoded
token (``torch.cat``: a full copy of the cache per token and layer) and copies the whole cache again
each time a finished row is dropped. :class:`SlabCache` allocates each layer's keys and values once, at
the batch's final length (prompt block + the longest ``max_new_tokens``), writes new positions in place
and hands attention a view of the positions written so far: the same tensors' values and shapes as the
growing cache, without the copies.

**Decode rows.** :class:`DecodeBatch` keeps the attention mask in a buffer of the same capacity and
retires finished rows lazily: a finished row stays in the batch (fed a pad token, masked, its position
held) until a quarter of the rows are finished, then the live rows are gathered in one copy. Sampling,
callbacks and outputs only ever see live rows, in their original order, so the generator draws the
same numbers as when every finished row is dropped at once.

**Joining rows** (continuous batching): :func:`join_batches` makes one batch of a running batch's live rows
and a freshly prefilled batch: both right-aligned at the longer of the two lengths (positions are explicit,
so moving a row's columns changes nothing it sees; the gap on the left is zeros, masked), in a new slab with
room for the longest remaining decode. One copy of the live rows, like a retire's gather.

**Prefix entries.** :class:`PrefixEntry` is a session's cached KV kept between turns.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer

from mosaic.agent.policies.scripted import copies, gather_rows, join_slabs, row_copies

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (H_kv, T, D)


class PrefixEntry:
    """A session's cached KV: ``kv[layer] = (keys, values)``, each (H_kv, T, D), for ``ids`` (T,)."""

    __slots__ = ("ids", "kv")

    def __init__(self, ids: list[int], kv: KV) -> None:
        self.ids, self.kv = ids, kv


class SlabLayer(DynamicLayer):
    """A :class:`DynamicLayer` whose ``keys``/``values`` are views of buffers allocated once."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.slab_k: torch.Tensor | None = None
        self.slab_v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, _, _, _ = key_states.shape
        self.slab_k = key_states.new_empty((B, key_states.shape[1], self.capacity, key_states.shape[3]))
        self.slab_v = value_states.new_empty((B, value_states.shape[1], self.capacity, value_states.shape[3]))
        self.length = 0
        self._views()
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self.slab_k[:, :, : self.length]
        self.values = self.slab_v[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:  # a caller's capacity was short: grow once (a copy) rather than fail
            self._grow(max(end, 2 * self.capacity))
        self.slab_k[:, :, self.length : end] = key_states
        self.slab_v[:, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def written(self, length: int) -> None:
        """The first ``length`` positions are written (by a caller that wrote into the buffers itself)."""
        self.length = length
        self._views()

    def _grow(self, capacity: int) -> None:
        k, v = self.slab_k, self.slab_v
        self.slab_k = k.new_empty((*k.shape[:2], capacity, k.shape[3]))
        self.slab_v = v.new_empty((*v.shape[:2], capacity, v.shape[3]))
        self.slab_k[:, :, : self.length] = k[:, :, : self.length]
        self.slab_v[:, :, : self.length] = v[:, :, : self.length]
        self.capacity = capacity

    @classmethod
    def of(cls, slab_k: torch.Tensor, slab_v: torch.Tensor, length: int) -> "SlabLayer":
        """A layer over given buffers (B, H_kv, capacity, D) whose first ``length`` positions are written."""
        layer = cls(slab_k.shape[2])
        layer.dtype, layer.device = slab_k.dtype, slab_k.device
        layer.slab_k, layer.slab_v, layer.length = slab_k, slab_v, length
        layer._views()
        layer.is_initialized = True
        return layer

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (in that order): their written positions are copied into new buffers of
        the same capacity with ``index_select`` (a row copy per kept row; advanced indexing ``slab[indices]``
        took ~6x longer on CPU and copied the unwritten positions too)."""
        if self.is_initialized:
            self.slab_k, self.slab_v = gather_rows([self.slab_k, self.slab_v], indices, self.length)
            self._views()


class SlabCache(DynamicCache):
    """A cache of :class:`SlabLayer` (``capacity`` positions per row), for full-attention models."""

    def __init__(self, num_layers: int, capacity: int, layers: list[SlabLayer] | None = None, *,
                 scripted: bool = True) -> None:
        """``scripted``: its copies run as TorchScript calls (:func:`~mosaic.agent.policies.scripted.copies`)."""
        Cache.__init__(self, layers=layers if layers is not None else [SlabLayer(capacity) for _ in range(num_layers)])
        self.scripted = scripted

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` of every layer (as :meth:`SlabLayer.batch_select_indices`), all layers'
        buffers in one TorchScript call where it compiles (:mod:`~mosaic.agent.policies.scripted`)."""
        layers = self.layers
        if not all(L.is_initialized and L.length == layers[0].length for L in layers):
            return super().batch_select_indices(indices)
        slabs = [L.slab_k for L in layers] + [L.slab_v for L in layers]
        out = copies(gather_rows, self.scripted)(slabs, indices, layers[0].length)
        for L, k, v in zip(layers, out[: len(layers)], out[len(layers):]):
            L.slab_k, L.slab_v = k, v
            L.written(L.length)


def full_attention(config: PretrainedConfig) -> bool:
    """Every layer of the model is plain full attention (no sliding window, no other layer kind)."""
    text = config.get_text_config(decoder=True)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    # a window set counts unless the config says it is off (Qwen2's use_sliding_window; Mistral has no switch)
    sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    return kinds == {"full_attention"} and not sliding


def make_cache(config: PretrainedConfig, capacity: int, *, slab: bool = True, scripted: bool = True) -> DynamicCache:
    """A :class:`SlabCache` when every layer is plain full attention, else HF's growing cache."""
    if slab and full_attention(config):
        return SlabCache(config.get_text_config(decoder=True).num_hidden_layers, capacity, scripted=scripted)
    return DynamicCache(config=config)


class DecodeBatch:
    """The rows of one batched decode: cache, attention mask buffer (B, capacity), live rows."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor, length: int, rows: torch.Tensor,
                 next_pos: torch.Tensor, pad_id: int) -> None:
        self.cache, self.mask, self.length = cache, mask, length  # valid mask: mask[:, :length]
        self.rows = rows  # (B,) the request row of each batch row
        self.next_pos = next_pos  # (B,) position of the next fed token
        self.live = torch.ones_like(rows, dtype=torch.bool)
        self.n_live = len(rows)
        self.pad_id = pad_id

    def live_index(self) -> torch.Tensor | None:
        """Batch indices of the live rows (ascending), or None when every row is live."""
        return None if self.n_live == len(self.rows) else self.live.nonzero().squeeze(1)

    def kv_of(self, a: int) -> KV:
        """A copy of batch row ``a``'s valid cache positions."""
        idx = self.mask[a, : self.length].nonzero().squeeze(1)  # once for every layer
        if len(idx) == self.length:  # nothing masked: one plain copy
            idx = None
        layers = self.cache.layers
        fn = copies(row_copies, getattr(self.cache, "scripted", False))  # (every layer in one call)
        out = fn([t for layer in layers for t in (layer.keys, layer.values)], a, idx)
        return list(zip(out[0::2], out[1::2]))

    def retire(self, idx: torch.Tensor) -> None:
        """Mark batch rows ``idx`` finished; gather the live rows once a quarter are finished."""
        self.live[idx] = False
        self.n_live -= len(idx)
        if 4 * self.n_live <= 3 * len(self.rows):
            keep = self.live.nonzero().squeeze(1)
            self.cache.batch_select_indices(keep)
            self.mask, self.rows, self.next_pos = self.mask[keep], self.rows[keep], self.next_pos[keep]
            self.live = self.live[keep]

    def feed(self, tokens: torch.Tensor) -> dict:
        """Model inputs for one decode step; ``tokens`` (n_live,): the live rows' last samples."""
        if self.n_live == len(self.rows):
            ids = tokens
        else:
            ids = torch.full_like(self.rows, self.pad_id)
            ids[self.live] = tokens
        if self.length == self.mask.shape[1]:  # (never with a correct capacity)
            self.mask = torch.cat([self.mask, torch.zeros_like(self.mask)], dim=1)
        self.mask[:, self.length] = self.live
        self.length += 1
        inputs = {"input_ids": ids[:, None], "attention_mask": self.mask[:, : self.length],
                  "position_ids": self.next_pos[:, None]}
        self.next_pos = self.next_pos + self.live
        return inputs


def join_batches(a: DecodeBatch, b: DecodeBatch, room: int) -> DecodeBatch:
    """``a``'s live rows, then all of ``b``'s, as one batch (both :class:`SlabCache`, initialised): each part
    right-aligned at the longer length ``L`` (zeros and a 0 mask on the left), capacity ``L + room``; ``a``'s
    leading columns that none of its live rows uses are left out."""
    keep = a.live.nonzero().squeeze(1)
    na, nb = len(keep), len(b.rows)
    # columns no live row uses any more (left of every kept row's first position) are dropped, so a
    # long-running batch does not grow with the steps it has run
    used = a.mask[keep, : a.length].any(0).nonzero() if na else None
    start = int(used[0]) if used is not None and len(used) else a.length
    La, Lb = a.length - start, b.length
    L = max(La, Lb)
    # (index_select into the strided target: one row copy each, no advanced-indexing temporary; every layer's
    # buffers in one call where TorchScript compiles it)
    fn = copies(join_slabs, b.cache.scripted)
    n = len(a.cache.layers)
    bs = [x for lb in b.cache.layers for x in (lb.slab_k, lb.slab_v)]
    out = fn([x for la in a.cache.layers for x in (la.slab_k, la.slab_v)] if na else bs, bs, keep, start, La, Lb, room)
    layers = [SlabLayer.of(out[2 * i], out[2 * i + 1], L) for i in range(n)]
    mask = b.mask.new_zeros((na + nb, L + room))
    mask[:na, L - La:L] = a.mask[keep, start:start + La]
    mask[na:, L - Lb:L] = b.mask[:, :Lb]
    rows = torch.cat([a.rows[keep], b.rows])
    next_pos = torch.cat([a.next_pos[keep], b.next_pos])
    cache = SlabCache(len(layers), L + room, layers, scripted=b.cache.scripted)
    return DecodeBatch(cache, mask, L, rows, next_pos, b.pad_id)
