"""Log-probs of many rows that share token prefixes, each shared prefix run through the model once.

The rows of a training step share a great deal: every rollout of a group starts from the same system
prompt and task, rollouts of a group often sample the same first turns, and every session of a
trajectory after a compaction starts from the same prompt again. On the CPU preset's batches the rows
hold about 4.5x as many tokens as their distinct prefixes (a trie over a step's rows: 9,359 nodes for
41,928 tokens). :func:`tree_logprobs` builds a radix tree over the rows' ids (one node per run of positions
shared by the same set of rows), runs the nodes level by level (a node's keys and values are the
positions it adds; it attends to its ancestors' through a KV cache, left-padded per batch of nodes; a level's
nodes are cut into batches of similar lengths, :func:`level_batches`) and
reads each row's completion log-probs from the hidden states of the nodes on its path.

With causal attention the hidden state at a position depends only on the ids up to it, so this is the
same computation as a padded forward over every row (:func:`~mosaic.train.batching.completion_logprobs`):
equal to float rounding (the matrix products have other shapes), and the gradient of a loss over the rows
is the same too — a shared position's gradient is the sum of what every row sharing it sends back
(tested against the padded path). Only models whose logits are ``head(decoder(...))`` take this path
(:func:`~mosaic.train.batching.plain_head`); others use the padded one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from mosaic.train.batching import PackedRow, plain_head, trim


@dataclass
class Node:
    """Positions ``start .. end - 1`` shared by every row below this node; ``parent`` -1 at a root."""

    start: int
    end: int
    parent: int
    level: int
    tokens: list[int]
    children: int = 0


def build_tree(seqs: Sequence[Sequence[int]]) -> tuple[list[Node], list[list[int]]]:
    """The radix tree over ``seqs``: its nodes, and for each sequence the nodes from a root to where it ends
    (their segments tile the sequence's positions in order)."""
    nodes: list[Node] = []
    paths: list[list[int]] = [[] for _ in seqs]
    stack = [(list(range(len(seqs))), 0, -1, 0)]  # (members, shared length, parent node, level)
    while stack:
        members, d, parent, level = stack.pop()
        first = seqs[members[0]]
        stop = min(len(seqs[m]) for m in members)
        k = d
        while k < stop and all(seqs[m][k] == first[k] for m in members):
            k += 1
        if k > d:  # (no node only where the members part at once: rows starting with different ids)
            nodes.append(Node(d, k, parent, level, list(first[d:k])))
            if parent >= 0:
                nodes[parent].children += 1
            parent, level = len(nodes) - 1, level + 1
            for m in members:
                paths[m].append(parent)
        groups: dict[int, list[int]] = {}
        for m in members:
            if len(seqs[m]) > k:
                groups.setdefault(seqs[m][k], []).append(m)
        stack += [(g, k, parent, level) for g in groups.values()]
    return nodes, paths


# What a forward over a batch of nodes costs, in padded query positions (each runs every projection and MLP):
# a call's fixed cost (4-layer model: launching ~40 operators forward and backward) and one padded
# (query, key) pair of attention. Fitted to forward + backward CPU time of the CPU preset's micro-batches.
CALL_COST = 200.0
PAIR_COST = 0.002
# On an accelerator padded positions run in parallel and a call's launch costs relatively more: there a batch
# is cut only where it saves more than this many padded positions. Not measured (no GPU has run this path).
ACCEL_CALL_COST = 4096.0


def level_batches(order: list[int], nodes: list[Node], max_tokens: int, *,
                  call_cost: float = CALL_COST) -> list[list[int]]:
    """A level's nodes in batches that pad little: every batch is padded to its longest past and its longest
    segment, so one long node among short ones would make them all pay for its length (one batch per level
    ran twice the attention pairs and 1.7x the query positions the nodes hold). The nodes are sorted by
    segment, then past length, and cut into the contiguous batches of least total cost (``call_cost`` per
    forward + ``PAIR_COST`` per padded attention pair + 1 per padded query position: dynamic programming);
    a batch holds at most ``max_tokens`` padded positions (rows x (past + segment)) unless it is one node."""
    items = sorted(order, key=lambda n: (nodes[n].end - nodes[n].start, nodes[n].start))
    best = [0.0] + [float("inf")] * len(items)
    cut = [0] * (len(items) + 1)
    for j in range(1, len(items) + 1):
        seg = nodes[items[j - 1]].end - nodes[items[j - 1]].start  # the longest segment of items[i:j]
        past = 0
        for i in range(j - 1, -1, -1):
            past = max(past, nodes[items[i]].start)
            rows = j - i
            if rows > 1 and rows * (past + seg) > max_tokens:
                break
            cost = best[i] + call_cost + rows * seg * (1.0 + PAIR_COST * (past + seg))
            if cost < best[j]:
                best[j], cut[j] = cost, i
    out, j = [], len(items)
    while j > 0:
        out.append(items[cut[j] : j])
        j = cut[j]
    return out[::-1]


def _run_nodes(decoder, nodes: list[Node], batch: list[int], kv: dict, dev) -> list[torch.Tensor]:
    """One forward over ``batch``'s segments, each after its parent's keys and values (left-padded);
    stores the new path KV of nodes with children in ``kv``; returns each node's hidden states (S_i, H)."""
    P = [nodes[n].start for n in batch]
    S = [nodes[n].end - nodes[n].start for n in batch]
    Pm, Sm, B = max(P), max(S), len(batch)
    ids = torch.zeros((B, Sm), dtype=torch.long)
    attn = torch.zeros((B, Pm + Sm), dtype=torch.long)
    for i, n in enumerate(batch):
        ids[i, : S[i]] = torch.tensor(nodes[n].tokens, dtype=torch.long)
        attn[i, Pm - P[i] : Pm] = 1
        attn[i, Pm : Pm + S[i]] = 1
    pos = torch.tensor(P)[:, None] + torch.arange(Sm)[None, :]
    cache = DynamicCache()
    if Pm > 0:  # every node of a level below the roots has a parent (past length = its start)
        layers = len(kv[nodes[batch[0]].parent])
        cache = DynamicCache(ddp_cache_data=[
            tuple(torch.stack([F.pad(kv[nodes[n].parent][layer][j], (0, 0, Pm - p, 0)) for n, p in zip(batch, P)])
                  for j in (0, 1))
            for layer in range(layers)])  # fmt: skip
    out = decoder(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev),
                  past_key_values=cache, use_cache=True)  # fmt: skip
    for i, n in enumerate(batch):
        if nodes[n].children:
            kv[n] = [(lay.keys[i, :, Pm - P[i] : Pm + S[i]], lay.values[i, :, Pm - P[i] : Pm + S[i]])
                     for lay in out.past_key_values.layers]  # fmt: skip
    return [out.last_hidden_state[i, : S[i]] for i in range(B)]


def tree_logprobs(model, rows: Sequence[PackedRow], *, temperature: float = 1.0, with_entropy: bool = False,
                  max_batch_tokens: int = 16384) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (R, Lc) of each row's completion tokens (gradient flows), laid out as
    :func:`~mosaic.train.batching.completion_logprobs` gives them for ``collate(rows, range(R))``
    (each trimmed as ``collate`` trims it; padding holds 0); with ``with_entropy`` the entropy at each, else None.
    ``max_batch_tokens``: most padded positions (rows x (past + segment)) in one forward."""
    head = plain_head(model)
    if head is None:
        raise ValueError("tree_logprobs needs a model whose logits are head(decoder(...)) (plain_head)")
    if any(not r.prompt_ids for r in rows):
        raise ValueError("tree_logprobs: a row without prompt ids has no logit for its first token")
    rows = [trim(r) for r in rows]
    seqs = [r.prompt_ids + r.completion_ids for r in rows]
    nodes, paths = build_tree(seqs)
    dev = next(model.parameters()).device
    decoder = model.get_decoder()
    hid: list[torch.Tensor | None] = [None] * len(nodes)
    call_cost = CALL_COST if dev.type == "cpu" else ACCEL_CALL_COST
    kv: dict[int, list] = {}
    for level in range(max((n.level for n in nodes), default=-1) + 1):
        here = [k for k, n in enumerate(nodes) if n.level == level]
        for batch in level_batches(here, nodes, max_batch_tokens, call_cost=call_cost):
            for n, h in zip(batch, _run_nodes(decoder, nodes, batch, kv, dev)):
                hid[n] = h
        for k in list(kv):  # a level's parents are done with once it has run
            if nodes[k].level < level:
                del kv[k]
    base, off = [], 0
    for n in nodes:
        base.append(off)
        off += n.end - n.start
    R, Lc = len(rows), max(max(len(r.completion_ids) for r in rows), 1) if rows else 1
    idx = torch.zeros((R, Lc), dtype=torch.long)
    target = torch.zeros((R, Lc), dtype=torch.long)
    valid = torch.zeros((R, Lc), dtype=torch.bool)
    for i, (r, path) in enumerate(zip(rows, paths)):
        bank = torch.cat([torch.arange(base[n], base[n] + nodes[n].end - nodes[n].start) for n in path])
        p, c = len(r.prompt_ids), len(r.completion_ids)
        idx[i, :c] = bank[p - 1 : p - 1 + c]  # the logit at position t predicts token t + 1
        target[i, :c] = torch.tensor(r.completion_ids, dtype=torch.long)
        valid[i, :c] = True
    uniq, inv = torch.unique(idx[valid], return_inverse=True)
    states = torch.cat(hid)[uniq.to(dev)]  # (U, H): every node ran (offsets in `base`); each position once
    logits = head(states)
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits.float(), dim=-1)  # (U, V)
    inv, valid, target = inv.to(dev), valid.to(dev), target.to(dev)
    lp = torch.zeros((R, Lc), dtype=logp_all.dtype, device=dev)
    lp = lp.masked_scatter(valid, logp_all[inv, target[valid]])
    ent = None
    if with_entropy:
        with torch.no_grad():
            e = -(logp_all.exp() * logp_all).sum(-1)
            ent = torch.zeros((R, Lc), dtype=e.dtype, device=dev).masked_scatter(valid, e[inv])
    return lp, ent
