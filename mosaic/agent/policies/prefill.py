"""Prefill of :class:`~mosaic.agent.policies.local.LocalPolicy`'s batches (see that module's docstring).

:func:`prefill` lays each row out as ``[pad][cached prefix][pad][uncached suffix]`` (left-padded blocks
of the batch's longest prefix and suffix, explicit positions) and runs the suffixes through the model,
after the rows' cached keys and values, into a cache with room for the decode. Rows of very different
lengths are run in groups of similar rows (:func:`prefill`); identical prompts once
(:func:`prefill_shared`). ``pol``: the :class:`~mosaic.agent.policies.local.LocalPolicy` (its model,
config, pad id and cache statistics).
"""

from __future__ import annotations

import torch

from mosaic.agent.policies.kvcache import DecodeBatch, PrefixEntry, full_attention, make_cache
from mosaic.agent.policy import GenRequest


def _pad_waste(cached: list[int], suffix: list[int], rows) -> float:
    """Share of a left-padded prefill block's attention work (queries x keys) spent on padding."""
    rows = list(rows)
    P, S = max(cached[b] for b in rows), max(suffix[b] for b in rows)
    real = sum(suffix[b] * (cached[b] + suffix[b]) for b in rows)
    return 1.0 - real / max(1, len(rows) * S * (P + S))


def _layout_mask(cached: list[int], suffix: list[int], room: int) -> torch.Tensor:
    """The rows' attention mask over ``[pad][cached prefix][pad][suffix]`` plus ``room`` decode positions:
    (B, P + S + room), 1 on each row's real positions."""
    P, S = max(cached), max(suffix)
    mask = torch.zeros((len(cached), P + S + room), dtype=torch.long)
    for b, (c, s) in enumerate(zip(cached, suffix)):
        mask[b, P - c:P] = 1
        mask[b, P + S - s:P + S] = 1
    return mask


def prefill(pol, reqs: list[GenRequest], prefixes: list[tuple[PrefixEntry, int] | None], room: int = 0):
    """Batched prefill of the rows' uncached suffixes (:func:`prefill_block`), in groups of
    ``prefill_group`` rows of similar lengths when one padded block would waste more than
    ``prefill_pad_waste`` of its attention work; the groups' KV are then laid out in the whole batch's
    blocks (same layout, mask and positions as one call)."""
    B = len(reqs)
    g = pol.config.prefill_group
    cached = [p[1] if p else 0 for p in prefixes]
    suffix = [len(r.prompt_ids) - c for r, c in zip(reqs, cached)]
    # (full attention only: a sliding-window cache keeps its own window of positions, not this layout)
    if (g <= 0 or B <= g or not full_attention(pol.model.config)
            or _pad_waste(cached, suffix, range(B)) <= pol.config.prefill_pad_waste):
        return prefill_block(pol, reqs, prefixes, room)
    P, S = max(cached), max(suffix)
    order = sorted(range(B), key=lambda b: (suffix[b], cached[b]))
    groups = [order[i:i + g] for i in range(0, B, g)]
    logits = None
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for idx in groups:
        lg, part = prefill_block(pol, [reqs[b] for b in idx], [prefixes[b] for b in idx], 0, slab=False)
        Pg, Sg = max(cached[b] for b in idx), max(suffix[b] for b in idx)
        if logits is None:
            logits = lg.new_empty((B, lg.shape[-1]))
            for layer in part.cache.layers:  # zeros: masked positions never turn into NaN through 0 * garbage
                k = layer.keys
                kv.append((k.new_zeros((B, k.shape[1], P + S, k.shape[3])),
                           layer.values.new_zeros((B, layer.values.shape[1], P + S, layer.values.shape[3]))))
        rows = torch.tensor(idx, device=pol.device)
        logits[rows] = lg
        for (K, V), layer in zip(kv, part.cache.layers):
            K[rows, :, P - Pg:P] = layer.keys[:, :, :Pg]
            V[rows, :, P - Pg:P] = layer.values[:, :, :Pg]
            K[rows, :, P + S - Sg:] = layer.keys[:, :, Pg:]
            V[rows, :, P + S - Sg:] = layer.values[:, :, Pg:]
    pol.cache_stats["prefill_groups"] = pol.cache_stats.get("prefill_groups", 0) + len(groups)
    cache = make_cache(pol.model.config, P + S + room, slab=pol.config.slab_cache, scripted=pol.scripted_copies)
    for layer, (K, V) in enumerate(kv):
        cache.update(K, V, layer)
    mask = _layout_mask(cached, suffix, room).to(pol.device)
    next_pos = torch.tensor([len(r.prompt_ids) for r in reqs], device=pol.device)
    return logits, DecodeBatch(cache, mask, P + S, torch.arange(B, device=pol.device), next_pos, pol.pad_id)


def prefill_block(pol, reqs: list[GenRequest], prefixes: list[tuple[PrefixEntry, int] | None], room: int = 0,
                   *, slab: bool | None = None):
    """Batched prefill of each prompt's uncached suffix after its cached prefix, into a cache with
    ``room`` more positions per row (the decode's).

    Row layout along the cache axis: ``[pad][cached prefix c_b][pad][suffix s_b]``: the
    past block is ``P = max c`` wide, the new block ``S = max s``; pads are masked out
    and positions are explicit, so each row sees exactly its own sequence.
    Returns (logits (B, V), :class:`DecodeBatch` over the B rows).
    """
    B = len(reqs)
    cached = [p[1] if p else 0 for p in prefixes]
    suffix = [len(r.prompt_ids) - c for r, c in zip(reqs, cached)]
    P, S = max(cached), max(suffix)
    input_ids = torch.full((B, S), pol.pad_id, dtype=torch.long)
    mask = _layout_mask(cached, suffix, room)
    positions = torch.zeros((B, S), dtype=torch.long)
    for b, r in enumerate(reqs):
        c, s = cached[b], suffix[b]
        input_ids[b, S - s:] = torch.tensor(r.prompt_ids[c:], dtype=torch.long)
        positions[b, S - s:] = torch.arange(c, c + s)
    cache = make_cache(pol.model.config, P + S + room, slab=pol.config.slab_cache if slab is None else slab,
                       scripted=pol.scripted_copies)
    if P > 0:
        _fill_past(cache, prefixes, cached, P)
    pol.cache_stats["reused_tokens"] += sum(cached)
    pol.cache_stats["prefilled_tokens"] += sum(suffix)
    input_ids, mask, positions = (t.to(pol.device) for t in (input_ids, mask, positions))
    step = pol.fast_step()
    if step is not None:  # the lean forward: no copied keys, no per-call machinery (fastdecode's docstring)
        logits = step(input_ids, mask[:, :P + S], positions, cache)
    else:
        logits = pol.model(input_ids=input_ids, attention_mask=mask[:, :P + S], position_ids=positions,
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]
    next_pos = torch.tensor([len(r.prompt_ids) for r in reqs], device=pol.device)
    rows = torch.arange(B, device=pol.device)
    return logits, DecodeBatch(cache, mask, P + S, rows, next_pos, pol.pad_id)


def _fill_past(cache, prefixes: list[tuple[PrefixEntry, int] | None], cached: list[int], P: int) -> None:
    """Write the cached prefixes, right-aligned in a ``P``-wide block, as the cache's first positions."""
    ref = next(p for p in prefixes if p)[0].kv
    for layer, (k0, v0) in enumerate(ref):
        keys = k0.new_zeros((len(prefixes), k0.shape[0], P, k0.shape[2]))
        values = v0.new_zeros((len(prefixes), v0.shape[0], P, v0.shape[2]))
        for b, pre in enumerate(prefixes):
            if pre:
                c = cached[b]
                keys[b, :, P - c:] = pre[0].kv[layer][0][:, :c]
                values[b, :, P - c:] = pre[0].kv[layer][1][:, :c]
        cache.update(keys, values, layer)


def prefill_shared(pol, reqs: list[GenRequest], prefixes: list[tuple[PrefixEntry, int] | None],
                    room: int = 0):
    """:func:`prefill`, with identical prompts prefilled once and their rows copied (the sampler still draws
    each row on its own). A group's G samples of one task open with the same prompt, and with a small policy
    many of them then take the same action and get the same tool result, so their next prompts are equal
    too: on the cpu preset's training rollouts such rows held a third of the tokens left to prefill. A
    repeated prompt runs from its first row's cached prefix (the same ids, so the same keys and values)."""
    first: dict[tuple[int, ...], int] = {}
    uniq: list[int] = []
    where: list[int] = []
    for b, r in enumerate(reqs):
        k = tuple(r.prompt_ids)
        if k in first:
            where.append(first[k])
            continue
        first[k] = len(uniq)
        where.append(len(uniq))
        uniq.append(b)
    if len(uniq) == len(reqs):
        return prefill(pol, reqs, prefixes, room)
    logits, batch = prefill(pol, [reqs[b] for b in uniq], [prefixes[b] for b in uniq], room)
    idx = torch.tensor(where, device=pol.device)
    batch.cache.batch_select_indices(idx)
    pol.cache_stats["shared_prefill_rows"] += len(reqs) - len(uniq)
    next_pos = torch.tensor([len(r.prompt_ids) for r in reqs], device=pol.device)
    rows = torch.arange(len(reqs), device=pol.device)
    return logits[idx], DecodeBatch(batch.cache, batch.mask[idx], batch.length, rows, next_pos, pol.pad_id)
