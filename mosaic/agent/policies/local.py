"""A ``transformers`` causal LM behind the :class:`~mosaic.agent.policy.Policy` protocol.

One :meth:`LocalPolicy.generate` call samples one assistant turn for every
request, batched with a KV cache:

1. **Prefill.** Prompts are left-padded into one ``(B, L)`` batch with an attention
   mask and explicit position ids (``cumsum(mask) - 1``), so every row sees exactly
   the positions it would see alone. Only the last position's logits are computed.
   When the rows' lengths differ a lot (more than ``prefill_pad_waste`` of the block's attention work
   would go to padding), the rows are prefilled in groups of ``prefill_group`` rows of similar
   lengths, each padded only to its own longest prefix and suffix, and their keys and values are
   then laid out in the whole batch's block: same layout, mask and positions as one call, the same
   logits within float rounding.
2. **Decode.** One token per live row per step, fed with the KV cache: a
   :class:`~mosaic.agent.policies.kvcache.SlabCache` allocated once at the batch's final length (no
   copy per token). A row that samples an end-of-turn id (or reaches its ``max_new_tokens``) finishes;
   finished rows are dropped from the batch in one gather once a quarter of it has finished
   (:class:`~mosaic.agent.policies.kvcache.DecodeBatch`), so finished sessions cost little while the
   rest keep going.
   For Llama/Qwen2-family models each step runs the layers' operations directly
   (:mod:`~mosaic.agent.policies.fastdecode`): the model's own logits to float rounding, without
   ``transformers``' per-call overhead and with a grouped one-query attention.

3. **Continuous batching** (``continuous_batching``; the server turns it on): when more requests wait than
   the batch holds (or a server's queue, ``more``, has new ones), rows join the running decode as rows
   finish: prefilled, then laid out beside the live rows (:func:`~mosaic.agent.policies.kvcache.join_batches`),
   each request's result handed over as it finishes (``on_result``). Bookkeeping in
   :mod:`~mosaic.agent.policies.running`.

Sampling: temperature, then top-p (nucleus), from a seeded ``torch.Generator``
owned by the policy (a run is reproducible for the same sequence of calls and
batch compositions). ``temperature == 0`` is greedy.

Log-probs (``GenResult.logprobs``): under the processed distribution actually sampled from
(:func:`~mosaic.agent.policies.sampling.sample_next`); every result also carries ``raw_logprobs`` (a
:class:`LocalGenResult`): the unprocessed model log-probs of the same tokens, what a PPO ratio wants
when the rollout used a different temperature.

Prefix cache (``prefix_cache=True``, default): a session's next prompt extends its
previous prompt + sampled ids + inserted tool tokens, so after each turn the session's
KV cache (prompt + sampled ids but the last, which was never fed) is kept, keyed by
``session_key``; the next turn prefills only the new suffix, batched with the other
rows' suffixes after their cached prefixes. A prompt that does not extend the cached
ids (a rewritten context) falls back to a full prefill. ``release`` frees a session;
the cache is LRU-bounded (``prefix_cache_tokens``) and dropped whenever the weights
change in place (parameter version counters, e.g. after ``optimizer.step()``). In
``bench/rollout.py`` (32 trajectories, 1,024-token budget, CPU) it cut prefilled tokens
from 94k to 16k and took the harness from 0.98x to 2.1x raw ``model.generate`` throughput.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mosaic.agent.policies.fastdecode import DecodeStep, decode_step_for
from mosaic.agent.policies.kvcache import KV, PrefixEntry, full_attention, join_batches
from mosaic.agent.policies.prefill import prefill, prefill_shared
from mosaic.agent.policies.running import Call, Rows
from mosaic.agent.policies.sampling import Sampling, common_prefix, default_stop_ids, sample_next
from mosaic.agent.policy import GenRequest, GenResult

__all__ = ["LocalGenResult", "LocalPolicy", "LocalPolicyConfig", "StepCallback", "default_stop_ids", "sample_next"]
_common_prefix = common_prefix  # (the name the tests know)

log = logging.getLogger(__name__)


# on_step(indices, tokens, logprobs) -> indices to end now (they finish as "stop"), or None
StepCallback = Callable[[list[int], list[int], list[float]], Iterable[int] | None]


@dataclass
class LocalGenResult(GenResult):
    """A :class:`GenResult` that also carries the raw (temperature 1, no top-p) log-probs."""

    raw_logprobs: list[float] | None = None


@dataclass(frozen=True)
class LocalPolicyConfig:
    """Sampling and batching knobs of :class:`LocalPolicy`."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    max_batch_size: int = 64
    """Most sequences decoded together; bigger request lists are split into chunks."""
    stop_token_ids: tuple[int, ...] | None = None
    """Ids that end a turn (kept in the output); ``None``: the model's eos id(s) and ``<|im_end|>``."""
    seed: int = 0
    """Seed of the sampling generator."""
    prefix_cache: bool = True
    """Keep each session's KV cache between turns and prefill only the new suffix (the
    harness extends a session's context turn by turn); ``release`` frees it."""
    prefix_cache_tokens: int = 1 << 20
    """Most tokens kept across all cached sessions (least recently used evicted first)."""
    shared_prefix: bool = False
    """Look a prompt up among *every* cached sequence (the longest common prefix wins, at least
    ``shared_prefix_min`` tokens) instead of its own session's: for a server, whose requests carry no
    session (each HTTP call re-sends the whole context). Entries are kept, not consumed, so the G samples of
    one prompt all start from it."""
    shared_prefix_min: int = 16
    prefill_group: int = 8
    """Rows per prefill group when a batch's prompts differ enough in length (0: one padded block). Each group is
    padded only to its own longest cached prefix and suffix; rows are grouped by length."""
    prefill_pad_waste: float = 0.1
    """Group the prefill when one padded block would spend more than this share of its attention on padding."""
    fast_decode: bool = True
    """Decode steps and prefill blocks of Llama/Qwen2-family models run their layers' operations directly
    (:mod:`~mosaic.agent.policies.fastdecode`: the model's own logits, without ``transformers``' per-call
    overhead or its copies of grouped keys and values); other models, or a model with hooks, always go
    through ``model(...)``."""
    scripted_decode: bool = True
    """With ``fast_decode``, a decode step's layers run as one TorchScript call where
    :mod:`~mosaic.agent.policies.scripted` covers the model (float32 on the CPU, the shipped models' kind), and
    the slab cache's copies likewise: the same operations and values, less interpreter overhead. False (or
    ``fast_decode=False``): nothing is compiled."""
    continuous_batching: bool = False
    """More requests than ``max_batch_size`` (or a server's queue) decode as one running batch: rows that finish
    leave it and waiting rows join (prefilled, then laid out beside the live rows), so the batch stays full
    instead of draining chunk by chunk. Needs the slab cache (full-attention models); otherwise, or when
    False, the requests run in chunks of ``max_batch_size``. The batch's composition decides the order of
    the sampler's draws, so sampled tokens differ from the chunked path's (greedy tokens do not, within
    float rounding). Off by default: on an evaluation of 256 trajectories in rounds it was not faster on CPU
    (the joining rows' prefills run in smaller groups); the server turns it on (requests arrive one by one)."""
    slab_cache: bool = True
    """Decode into KV buffers allocated once per batch (:class:`~mosaic.agent.policies.kvcache.SlabCache`)
    instead of HF's cache grown by a copy per token; the same tokens for the same generator state."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {self.max_batch_size}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens: must be >= 0, got {self.prefix_cache_tokens}")


class LocalPolicy:
    """Batched KV-cache sampling from an in-process ``transformers`` causal LM."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None,
                 config: LocalPolicyConfig | None = None, *, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        """Wrap ``model`` (moved to ``device``; fp32 on CPU unless ``dtype`` says otherwise)."""
        self.config = config or LocalPolicyConfig()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if dtype is None and self.device.type == "cpu":
            dtype = torch.float32
        self.model = model.to(self.device, dtype=dtype) if dtype is not None else model.to(self.device)
        self.model.eval()
        self.stop_ids = tuple(self.config.stop_token_ids or default_stop_ids(model, tokenizer))
        pad = getattr(model.config, "pad_token_id", None)
        self.pad_id = pad if pad is not None else self.stop_ids[0]
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self._stop = torch.tensor(self.stop_ids, device=self.device)
        self._cache: OrderedDict[str, PrefixEntry] = OrderedDict()  # LRU, oldest first
        self._cached_tokens = 0
        self._weights_version = self._version()
        self._fast: DecodeStep | None = None
        self.cache_stats = {"hits": 0, "misses": 0, "reused_tokens": 0, "prefilled_tokens": 0,
                            "evictions": 0, "invalidations": 0, "shared_prefill_rows": 0,
                            "joined_rows": 0, "joins_shifted": 0}

    # ---------------------------------------------------------------- protocol
    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Sample one turn for every request; results in request order, never raises on bad input."""
        return self.generate_with(requests)

    def generate_with(self, requests: Sequence[GenRequest], *, temperature: float | None = None,
                      top_p: float | None = None, stop_token_ids: Sequence[int] | None = None,
                      generator: torch.Generator | None = None,
                      on_step: StepCallback | None = None,
                      more: Callable[[int], Sequence[GenRequest]] | None = None,
                      on_result: Callable[[int, GenResult], None] | None = None) -> list[GenResult]:
        """:meth:`generate` with per-call sampling overrides (what the server uses).

        ``on_step(indices, tokens, logprobs)`` is called after every decode step with the
        request indices that got a token, the tokens and their sampling log-probs (streaming);
        it may return request indices to end after that token (finish ``stop``: the server's
        stop strings), or None.

        Continuous batching: more requests than ``max_batch_size`` are decoded as one running batch that
        finished rows leave and waiting rows join (:meth:`_generate_batch`); ``more(free)`` (the server's
        queue) is asked for new requests whenever rows are free, numbered after the ones before;
        ``on_result(index, result)`` is called as each request finishes (before the call returns). Only a
        batch with the slab cache (full-attention models) takes rows in; otherwise the requests run in
        chunks of ``max_batch_size`` one after another, and ``more`` is not asked.
        """
        sampling = Sampling(
            self.config.temperature if temperature is None else temperature,
            self.config.top_p if top_p is None else top_p,
            self._stop if stop_token_ids is None
            else torch.tensor(list(stop_token_ids), dtype=torch.long, device=self.device),
            generator or self.generator)
        self._check_weights()
        call = Call(self, requests, more, on_result, LocalGenResult)
        call.sort_waiting()
        step = self.config.max_batch_size
        joining = (len(call.waiting) > step or more is not None) and self._joinable()
        if not joining:
            call.more = None
        while idx := call.take(step):
            try:
                self._generate_batch(idx, call, sampling, on_step, joining)
            except Exception as exc:  # e.g. out of memory: fail these rows, keep the rollout alive
                log.exception("LocalPolicy batch failed")
                call.fail(call.started if joining else idx, exc)
        return call.results  # type: ignore[return-value]

    def _joinable(self) -> bool:
        """Rows can join a running decode: the slab cache over a full-attention model."""
        return self.config.continuous_batching and self.config.slab_cache and full_attention(self.model.config)

    def release(self, session_key: str) -> None:
        """Drop the session's cached prefix (no-op if none)."""
        entry = self._cache.pop(session_key, None)
        if entry is not None:
            self._cached_tokens -= len(entry.ids)

    def cached_prefix(self, session_key: str) -> tuple[list[int], KV] | None:
        """``(ids, kv)`` the session's cache holds under the current weights (``kv[layer] = (K, V)``, each
        (H_kv, len(ids), D)), or None (no cache, evicted, or the weights changed since). Read-only: the
        tensors are shared with the cache."""
        self._check_weights()
        entry = self._cache.get(session_key)
        return None if entry is None else (entry.ids, entry.kv)

    def longest_cached(self, ids: list[int]) -> tuple[int, KV] | None:
        """The cached keys/values of the longest prefix of ``ids`` any cache entry holds, under the current
        weights: ``(n, kv)`` with ``kv[layer] = (K, V)`` each (H_kv, n, D) (views of the cache), or None.
        What a scorer after the rollouts reads (a served policy's requests carry no session)."""
        self._check_weights()
        _, best, n = self._longest(ids, len(ids))
        if best is None:
            return None
        return n, [(K[:, :n], V[:, :n]) for K, V in best.kv]

    def handoff(self, session_key: str, new_key: str) -> None:
        """Move a session's cache to a new session whose prompt extends its context (a compaction turn is
        prompted with the whole main session it summarises): its prefill then starts from the cache."""
        entry = self._cache.pop(session_key, None)
        if entry is not None:
            self._cached_tokens -= len(entry.ids)
            self._store(new_key, entry.ids, entry.kv)

    def clear_cache(self) -> None:
        """Drop every cached prefix (done automatically when the weights change in place)."""
        self._cache.clear()
        self._cached_tokens = 0

    # ---------------------------------------------------------------- prefix cache
    def _version(self) -> int:
        # In-place updates (optimizer.step, load_state_dict) bump every tensor's version counter.
        return sum(p._version for p in self.model.parameters())

    def _check_weights(self) -> None:
        v = self._version()
        if v != self._weights_version:
            if self._cache:
                self.cache_stats["invalidations"] += 1
            self.clear_cache()
            self._weights_version = v

    def _lookup(self, req: GenRequest) -> tuple[PrefixEntry, int] | None:
        """(entry, reusable length) when the session's cached ids prefix this prompt."""
        if not self.config.prefix_cache:
            return None
        if self.config.shared_prefix:
            return self._lookup_shared(req.prompt_ids)
        entry = self._cache.pop(req.session_key, None)  # re-inserted fresh after this turn
        if entry is None:
            self.cache_stats["misses"] += 1
            return None
        self._cached_tokens -= len(entry.ids)
        n = min(len(entry.ids), len(req.prompt_ids) - 1)  # feed at least one token
        if n <= 0 or req.prompt_ids[:n] != entry.ids[:n]:
            self.cache_stats["misses"] += 1
            return None
        self.cache_stats["hits"] += 1
        return entry, n

    def _lookup_shared(self, prompt: list[int]) -> tuple[PrefixEntry, int] | None:
        """The cached sequence sharing the longest prefix with ``prompt`` (at most all but its last token)."""
        key, entry, n = self._longest(prompt, len(prompt) - 1)
        if entry is None or n < self.config.shared_prefix_min:
            self.cache_stats["misses"] += 1
            return None
        self._cache.move_to_end(key)  # recently used
        self.cache_stats["hits"] += 1
        return entry, n

    def _longest(self, ids: list[int], limit: int) -> tuple[str | None, PrefixEntry | None, int]:
        """(key, entry, n): the cache entry sharing the longest prefix with ``ids`` (n <= ``limit`` tokens, n > 0;
        the first such entry on a tie), or (None, None, 0)."""
        best: tuple[str | None, PrefixEntry | None, int] = (None, None, 0)
        for key, entry in self._cache.items():
            n = common_prefix(entry.ids, ids, limit)
            if n > best[2]:
                best = (key, entry, n)
        return best

    def _store(self, key: str, ids: list[int], kv: KV) -> None:
        if len(ids) > self.config.prefix_cache_tokens:
            return
        self.release(key)
        self._cache[key] = PrefixEntry(ids, kv)
        self._cached_tokens += len(ids)
        while self._cached_tokens > self.config.prefix_cache_tokens:
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= len(old.ids)
            self.cache_stats["evictions"] += 1

    # ---------------------------------------------------------------- internals
    def _check(self, req: GenRequest) -> str | None:
        if not req.prompt_ids:
            return "empty prompt_ids"
        vocab = self.model.get_input_embeddings().num_embeddings
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            return f"prompt_ids out of vocabulary range [0, {vocab}): {bad[:5]}"
        if self.max_positions is not None and len(req.prompt_ids) >= self.max_positions:
            return (f"prompt of {len(req.prompt_ids)} tokens does not fit the model's "
                    f"{self.max_positions} positions")
        return None

    def _max_new(self, req: GenRequest) -> int:
        if self.max_positions is None:
            return req.max_new_tokens
        return min(req.max_new_tokens, self.max_positions - len(req.prompt_ids))

    def fast_step(self) -> DecodeStep | None:
        """The lean forward of decode steps and prefill blocks (:mod:`~mosaic.agent.policies.fastdecode`) for
        this policy's model: the generate call's in progress (built from the weights as they were when the
        call began), else a new one; None when ``fast_decode`` is off or the model is not one it reproduces."""
        if self._fast is not None:
            return self._fast
        return self._new_step()

    @property
    def scripted_copies(self) -> bool:
        """The slab cache's copies run as TorchScript calls (``fast_decode`` and ``scripted_decode``)."""
        return self.config.fast_decode and self.config.scripted_decode

    def _new_step(self) -> DecodeStep | None:
        if not self.config.fast_decode:
            return None
        return decode_step_for(self.model, scripted=self.config.scripted_decode)

    def _prefill(self, reqs: list[GenRequest], prefixes: list[tuple[PrefixEntry, int] | None], room: int = 0):
        """:func:`~mosaic.agent.policies.prefill.prefill`: (last logits (B, V), :class:`DecodeBatch`)."""
        return prefill(self, reqs, prefixes, room)

    @torch.inference_mode()
    def _generate_batch(self, idx: list[int], call: Call, sampling: Sampling, on_step: StepCallback | None = None,
                        joining: bool = False) -> None:
        """:meth:`_decode_batch` with this call's lean forward (:meth:`fast_step`), built from the weights as they
        are now: whatever changed them since the last call (an optimizer step, a swap), it reads them anew."""
        self._fast = self._new_step()
        try:
            self._decode_batch(idx, call, sampling, on_step, joining)
        finally:
            self._fast = None

    def _decode_batch(self, idx: list[int], call: Call, sampling: Sampling, on_step: StepCallback | None,
                      joining: bool) -> None:
        """Prefill the requests ``idx`` of ``call``, then decode one token per live row per step until every row
        has finished; with ``joining``, the call's waiting requests join as rows finish (up to
        ``max_batch_size`` live rows, at least a quarter of it at a time unless the batch ran dry). Each
        request's result goes to ``call`` as its row finishes."""
        rows_ = Rows(self.device)
        rows_.add(idx, [self._max_new(call.requests[i]) for i in idx])
        logits, batch = prefill_shared(self, [call.requests[i] for i in idx], [call.prefixes[i] for i in idx],
                                       int(rows_.max_new.max()))
        step = self.fast_step()
        cap = self.config.max_batch_size
        while True:
            act = batch.live_index()
            rows = batch.rows if act is None else batch.rows[act]
            tok, lp, raw = sample_next(logits if act is None else logits[act], temperature=sampling.temperature,
                                       top_p=sampling.top_p, generator=sampling.generator)
            got = rows_.record(rows, tok, lp, raw)
            ended = on_step(*got) if on_step is not None else None
            stopped = torch.isin(tok, sampling.stop)
            if ended:
                stopped = stopped | torch.isin(rows, torch.tensor(rows_.rows_of(ended), device=rows.device))
            done = stopped | (rows_.left(rows) <= 0)
            live = len(rows)
            if bool(done.any()):
                gone = done.nonzero().squeeze(1)
                gone_b = gone if act is None else act[gone]
                live -= len(gone)
                for a, r, st in zip(gone_b.tolist(), rows[gone].tolist(), stopped[gone].tolist()):
                    rows_.finish[r] = "stop" if st else rows_.finish[r]
                    kv = batch.kv_of(a) if self.config.prefix_cache else None
                    call.finish(rows_.rid[r], self._result(call.requests[rows_.rid[r]], rows_.toks[r], rows_.lps[r],
                                                           rows_.raws[r], rows_.finish[r], kv))
                batch.retire(gone_b)
                tok = tok[~done]
            new = call.take(cap - live) if joining and (cap - live >= max(1, cap // 4) or live == 0) else []
            if live == 0 and not new:
                break
            if live:
                feed = batch.feed(tok)
                if step is not None:
                    logits = step(feed["input_ids"], feed["attention_mask"], feed["position_ids"], batch.cache)
                else:
                    logits = self.model(**feed, past_key_values=batch.cache, use_cache=True).logits[:, -1, :]
            if new:
                logits, batch = self._join(call, rows_, batch, logits, new, live)

    def _join(self, call: Call, rows_: Rows, batch, logits: torch.Tensor, new: list[int], live: int):
        """Prefill the joining requests ``new`` and lay them out after the batch's live rows: (logits, batch)."""
        first = rows_.add(new, [self._max_new(call.requests[i]) for i in new])
        lg, part = prefill_shared(self, [call.requests[i] for i in new], [call.prefixes[i] for i in new], 0)
        part.rows = part.rows + first
        keep = batch.live.nonzero().squeeze(1)
        room = int(rows_.left(torch.cat([batch.rows[keep] if live else part.rows[:0], part.rows])).max())
        self.cache_stats["joined_rows"] += len(new)
        self.cache_stats["joins_shifted"] += int(part.length < batch.length and live > 0)
        logits = torch.cat([logits[keep] if live else lg[:0], lg])
        return logits, join_batches(batch, part, room)

    def _result(self, req: GenRequest, toks: list[int], lps: list[float], raws: list[float], finish: str,
                kv: KV | None) -> LocalGenResult:
        """A finished row's result; caches its KV (prompt + sampled ids but the last, never fed)."""
        if kv is not None:
            ids = list(req.prompt_ids) + toks[:-1]
            if kv[0][0].shape[1] == len(ids):
                self._store(req.session_key, ids, kv)
            else:  # should not happen; never cache a misaligned prefix
                log.warning("prefix cache: %d cached positions for %d ids; not stored", kv[0][0].shape[1], len(ids))
        return LocalGenResult(toks, lps, finish, None, raws)  # type: ignore[arg-type]
