"""The forward passes of the gain scorer: answer probes off a session's KV cache, and the
from-scratch reference (see :mod:`mosaic.train.scorer` for what is scored and why it is cheap).

A *host* is a sequence to encode once; its *cuts* are the state lengths to probe. The cached path
encodes hosts in padded batches under a token budget and runs each probe's few tokens against the
host's cache cropped to the cut; the reference path re-encodes every state with its probe.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from mosaic.agent.chat import Probe
from mosaic.train.batching import plain_head as _plain_head
from mosaic.trace.graph import Session

__all__ = ["Host", "ScoreStats", "run_cached", "run_from_caches", "extend_cache", "run_reference", "recompute_logprobs_reference", "eval_mode"]


@dataclass
class ScoreStats:
    """Cost counters of one scoring call."""

    num_state_refs: int = 0
    """State references of non-final sessions (2 per session) before dedupe."""
    num_unique_states: int = 0
    """Distinct states after dedupe by ``state_key`` (= probes run)."""
    num_probes: int = 0
    sessions_encoded: int = 0
    """Host sequences encoded (cached path) or 0 (reference path)."""
    tokens_encoded: int = 0
    """Tokens run through the model, all passes together (host passes + probe passes)."""
    probe_tokens: int = 0
    """Of ``tokens_encoded``, tokens of the probe passes."""
    forward_calls: int = 0
    seconds: float = 0.0
    host_seconds: float = 0.0
    """Of ``seconds``, time in the session passes (cached path)."""
    probe_seconds: float = 0.0
    """Of ``seconds``, time in the probe passes incl. gathering their caches (cached path)."""

    def as_metrics(self, prefix: str = "timing_s/score") -> dict[str, float]:
        return {
            prefix: self.seconds,
            "score/probes": float(self.num_probes),
            "score/unique_states": float(self.num_unique_states),
            "score/state_refs": float(self.num_state_refs),
            "score/tokens_encoded": float(self.tokens_encoded),
        }


# --------------------------------------------------------------------------------------
# Work description shared by all paths: "hosts" (sequences to encode) with "cuts".


@dataclass
class Host:
    tokens: list[int]
    """The sequence to encode (already truncated to what is needed)."""
    cuts: list[int]
    """Distinct state lengths (prefixes of ``tokens``) to probe."""
    probe: Probe
    logprob_from: int | None = None
    """When set: return log-probs of ``tokens[logprob_from:]`` from this pass."""


# --------------------------------------------------------------------------------------
# Model helpers.


@contextlib.contextmanager
def eval_mode(model):
    """Score in eval mode (no dropout), then restore the caller's mode."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def _answer_loglik(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean log-prob of ``targets`` (n,) under ``logits`` (n, V), in fp32."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean()


def _chunked_token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head, temperature: float,
                            chunk: int = 1024) -> torch.Tensor:  # fmt: skip
    """Log-probs of ``targets`` (n,) given final hidden states (n, H), ``chunk`` rows at a time."""
    out = []
    for a in range(0, hidden.shape[0], chunk):
        logits = head(hidden[a : a + chunk]).float() / temperature  # (c, V)
        out.append(torch.log_softmax(logits, -1).gather(-1, targets[a : a + chunk, None]).squeeze(-1))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def _pack(lengths: Sequence[int], order: Sequence[int], max_tokens: int, max_batch: int,
          pad_tolerance: float = 0.25) -> list[list[int]]:  # fmt: skip
    """Greedy batches of ``order`` (sorted by decreasing length): padded size ≤ ``max_tokens``, at most
    ``max_batch`` items, and no item shorter than ``(1 - pad_tolerance)`` of its batch's longest
    (padding is pure waste on CPU and costly on GPU)."""
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for j in order:
        m = max(cur_max, lengths[j])
        if cur and ((len(cur) + 1) * m > max_tokens or len(cur) >= max_batch
                    or lengths[j] < (1.0 - pad_tolerance) * cur_max):  # fmt: skip
            batches.append(cur)
            cur, m = [], lengths[j]
        cur.append(j)
        cur_max = m
    if cur:
        batches.append(cur)
    return batches


# --------------------------------------------------------------------------------------
# Fast path.


@torch.no_grad()
# Long on purpose: the host passes and the probe passes share the batch's KV caches and padding bookkeeping; split apart they would pass half a dozen tensors back and forth.
def run_cached(model, hosts: list[Host], stats: ScoreStats, *, max_batch_tokens: int, max_batch_size: int,
                temperature: float) -> tuple[list[dict[int, float]], list[torch.Tensor | None]]:  # fmt: skip
    dev = _model_device(model)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    L: list[dict[int, float]] = [dict() for _ in hosts]
    logprobs: list[torch.Tensor | None] = [None] * len(hosts)
    lengths = [len(h.tokens) for h in hosts]
    order = sorted(range(len(hosts)), key=lambda j: -lengths[j])
    for batch in _pack(lengths, order, max_batch_tokens, max_batch_size):
        Lmax = max(lengths[j] for j in batch)
        ids = torch.zeros(len(batch), Lmax, dtype=torch.long)
        att = torch.zeros(len(batch), Lmax, dtype=torch.long)
        for r, j in enumerate(batch):
            ids[r, : lengths[j]] = torch.tensor(hosts[j].tokens)
            att[r, : lengths[j]] = 1
        t0 = time.perf_counter()
        # Without padding, no mask: lets the attention take its causal fast path.
        mask = None if all(lengths[j] == Lmax for j in batch) else att.to(dev)
        out = decoder(input_ids=ids.to(dev), attention_mask=mask, use_cache=True)
        stats.forward_calls += 1
        stats.sessions_encoded += len(batch)
        stats.tokens_encoded += sum(lengths[j] for j in batch)
        hid = out.last_hidden_state  # (b, Lmax, H)
        for r, j in enumerate(batch):
            a = hosts[j].logprob_from
            if a is not None:
                n = lengths[j]
                tgt = ids[r, a:n].to(dev)
                logprobs[j] = _chunked_token_logprobs(hid[r, a - 1 : n - 1], tgt, head, temperature).cpu()
        del hid
        kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]  # each (b, Hkv, Lmax, D)
        del out
        t1 = time.perf_counter()
        stats.host_seconds += t1 - t0
        rows_kv = [[(K[r], V[r]) for K, V in kv] for r in range(len(batch))]
        _probe_batch(model, rows_kv, [(r, j) for r, j in enumerate(batch)], hosts, L, stats,
                     max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size)
        del kv, rows_kv
        stats.probe_seconds += time.perf_counter() - t1
    return L, logprobs


class _FilledLayer(DynamicLayer):
    """A cache layer over preallocated buffers (``(B, H, capacity, D)``) holding ``n`` positions: an update
    writes the new positions in place instead of concatenating (which would copy the whole cache)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, n: int) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self._kb, self._vb = keys, values
        self.keys, self.values = keys[..., :n, :], values[..., :n, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n, new = self.keys.shape[-2], key_states.shape[-2]
        if n + new > self._kb.shape[-2]:
            return super().update(key_states, value_states, *args, **kwargs)
        self._kb[..., n : n + new, :] = key_states
        self._vb[..., n : n + new, :] = value_states
        self.keys, self.values = self._kb[..., : n + new, :], self._vb[..., : n + new, :]
        return self.keys, self.values


RowKV = list[tuple[torch.Tensor, torch.Tensor]]
"""One sequence's KV cache: per layer ``(K, V)``, each (Hkv, T, D)."""


@torch.inference_mode()
def extend_cache(model, tokens: list[int], past: RowKV, upto: int, stats: ScoreStats) -> RowKV:
    """``past`` (encoding ``tokens[:n]``) extended to encode ``tokens[:upto]`` (one forward over the tail;
    ``past`` itself is not modified; cropped when it already holds more)."""
    n = min(int(past[0][0].shape[1]), upto)
    if n >= upto:
        return [(K[:, :upto], V[:, :upto]) for K, V in past]
    dev = _model_device(model)
    cache = DynamicCache(ddp_cache_data=[(K[None, :, :n], V[None, :, :n]) for K, V in past])
    ids = torch.tensor([tokens[n:upto]], device=dev)
    pos = torch.arange(n, upto, device=dev)[None, :]
    out = model.get_decoder()(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
    stats.forward_calls += 1
    stats.tokens_encoded += upto - n
    return [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]


@torch.inference_mode()
def run_from_caches(model, hosts: list[Host], caches: list[RowKV], stats: ScoreStats, *,
                    max_batch_tokens: int = 16384, max_batch_size: int = 64) -> list[dict[int, float]]:  # fmt: skip
    """Probe every host's cuts off a KV cache the rollout policy already holds (the live path): ``caches[j]``
    encodes at least ``max(hosts[j].cuts) - 1`` tokens of ``hosts[j].tokens`` under the same weights (see
    :func:`extend_cache`). Only the probes run, batched across hosts, as in :func:`run_cached`."""
    t0 = time.perf_counter()
    L: list[dict[int, float]] = [dict() for _ in hosts]
    _probe_batch(model, caches, [(j, j) for j in range(len(hosts))], hosts, L, stats,
                 max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size)  # fmt: skip
    stats.probe_seconds += time.perf_counter() - t0
    return L


def _left_padded_cache(rows_kv: Sequence[RowKV], sel: list[tuple[int, int, int]], n_layers: int, Cm: int,
                       Pm: int) -> DynamicCache:
    """One cache for a probe batch: row i holds the first ``c_i - 1`` positions of its ``rows_kv`` left-padded to
    ``Cm``, with room for ``Pm`` probe tokens after them (the forward appends them in place, no copy)."""
    cache = DynamicCache()
    cache.layers = []
    n = len(sel)
    for layer in range(n_layers):
        K0, V0 = rows_kv[sel[0][0]][layer]
        Kb = K0.new_zeros((n, K0.shape[0], Cm + Pm, K0.shape[2]))
        Vb = V0.new_zeros((n, V0.shape[0], Cm + Pm, V0.shape[2]))
        for i, (r, _, c) in enumerate(sel):
            if c > 1:
                Kb[i, :, Cm - (c - 1) : Cm] = rows_kv[r][layer][0][:, : c - 1]
                Vb[i, :, Cm - (c - 1) : Cm] = rows_kv[r][layer][1][:, : c - 1]
        cache.layers.append(_FilledLayer(Kb, Vb, Cm))
    return cache


def _probe_batch(model, rows_kv: Sequence[RowKV], members: list[tuple[int, int]], hosts: list[Host],
                 L: list[dict[int, float]], stats: ScoreStats, *, max_batch_tokens: int, max_batch_size: int) -> None:
    """Run the probes of every ``(row, host)`` in ``members`` against ``rows_kv[row]`` (holding at least
    ``cut - 1`` positions of ``hosts[host].tokens``); writes ``L[host][cut]``."""
    dev = _model_device(model)
    # Probes: (row, host, cut), sorted by cut length.
    jobs = [(r, j, c) for (r, j) in members for c in hosts[j].cuts]
    # Each probe runs up to the end of its answer span: what follows (the closing tags) changes no logit
    # that scores the answer.
    plen = [c - 1 + 1 + hosts[j].probe[1][1] for (_, j, c) in jobs]
    porder = sorted(range(len(jobs)), key=lambda q: -plen[q])
    n_layers = len(rows_kv[0]) if rows_kv else 0
    for pb in _pack(plen, porder, max_batch_tokens, max_batch_size):
        sel = [jobs[q] for q in pb]
        n = len(sel)
        pre = torch.tensor([c - 1 for (_, _, c) in sel])  # cached prefix lengths
        seqs = [[hosts[j].tokens[c - 1]] + hosts[j].probe[0][: hosts[j].probe[1][1]] for (_, j, c) in sel]
        Cm, Pm = int(pre.max()), max(len(s) for s in seqs)
        # Left-pad the cached prefixes: slot k of row i holds position k - (Cm - pre_i).
        valid = (torch.arange(Cm)[None, :] - (Cm - pre)[:, None]) >= 0  # (n, Cm)
        cache = _left_padded_cache(rows_kv, sel, n_layers, Cm, Pm)
        pid = torch.zeros(n, Pm, dtype=torch.long)
        patt = torch.zeros(n, Cm + Pm, dtype=torch.long)
        patt[:, :Cm] = valid.long()
        for i, s in enumerate(seqs):
            pid[i, : len(s)] = torch.tensor(s)
            patt[i, Cm : Cm + len(s)] = 1
        posid = pre[:, None] + torch.arange(Pm)[None, :]  # true positions of the probe tokens
        kw = dict(input_ids=pid.to(dev), attention_mask=patt.to(dev), position_ids=posid.to(dev),
                  past_key_values=cache, use_cache=True)
        spans = [hosts[j].probe[1] for (_, j, _) in sel]
        head = _plain_head(model)
        if head is not None:  # the output layer only where an answer token is predicted
            hid = model.get_decoder()(**kw).last_hidden_state  # (n, Pm, H)
            logits = head(torch.cat([hid[i, a:b] for i, (a, b) in enumerate(spans)]))  # (sum spans, V)
        else:
            out = model(**kw).logits  # (n, Pm, V)
            logits = torch.cat([out[i, a:b] for i, (a, b) in enumerate(spans)])
        stats.forward_calls += 1
        stats.num_probes += n
        ptoks = sum(len(s) for s in seqs)
        stats.tokens_encoded += ptoks
        stats.probe_tokens += ptoks
        k = 0
        for i, (_, j, c) in enumerate(sel):
            a, b = spans[i]
            # seqs[i][t + 1] is predicted by position t; y is seqs[i][1 + a : 1 + b].
            tgt = pid[i, 1 + a : 1 + b].to(dev)
            L[j][c] = float(_answer_loglik(logits[k : k + b - a], tgt))
            k += b - a
        del cache, logits


# --------------------------------------------------------------------------------------
# Slow reference.


@torch.no_grad()
def run_reference(model, hosts: list[Host], stats: ScoreStats) -> list[dict[int, float]]:
    dev = _model_device(model)
    L: list[dict[int, float]] = [dict() for _ in hosts]
    for j, h in enumerate(hosts):
        suffix, (a, b) = h.probe
        for c in h.cuts:
            seq = torch.tensor([h.tokens[:c] + suffix], device=dev)
            logits = model(input_ids=seq).logits[0]  # (c + P, V)
            stats.forward_calls += 1
            stats.num_probes += 1
            stats.tokens_encoded += seq.shape[1]
            stats.probe_tokens += len(suffix)
            L[j][c] = float(_answer_loglik(logits[c + a - 1 : c + b - 1], seq[0, c + a : c + b]))
    return L


@torch.no_grad()
def recompute_logprobs_reference(model, session: Session, *, temperature: float = 1.0) -> torch.Tensor:
    """(len(completion_ids),) log-probs of a session's completion from a plain full forward."""
    dev = _model_device(model)
    toks = torch.tensor([session.tokens()], device=dev)
    p = len(session.prompt_ids)
    logits = model(input_ids=toks).logits[0].float() / temperature  # (N, V)
    lp = torch.log_softmax(logits[p - 1 : -1], -1)
    return lp.gather(-1, toks[0, p:, None]).squeeze(-1).cpu()
