"""A ``transformers`` causal LM behind the :class:`~mosaic.agent.policy.Policy` protocol.

One :meth:`LocalPolicy.generate` call samples one assistant turn for every
request, batched with a KV cache:

1. **Prefill.** Prompts are left-padded into one ``(B, L)`` batch with an attention
   mask and explicit position ids (``cumsum(mask) - 1``), so every row sees exactly
   the positions it would see alone. Only the last position's logits are computed.
2. **Decode.** One token per active row per step, fed with the KV cache. A row that
   samples an end-of-turn id (or reaches its ``max_new_tokens``) is *dropped* from
   the batch (its cache rows are index-selected away), so finished sessions cost
   nothing while the rest keep going.

Sampling: temperature, then top-p (nucleus), from a seeded ``torch.Generator``
owned by the policy (a run is reproducible for the same sequence of calls and
batch compositions). ``temperature == 0`` is greedy.

Log-probs (``GenResult.logprobs``): the log-probability of each sampled token
under the **processed distribution actually sampled from** (``log_softmax(logits /
T)`` restricted to the nucleus and renormalised). At ``T = 1, top_p = 1`` (the
training default) this is exactly the raw policy's ``log_softmax(logits)``. At
``T = 0`` the sampler is a point mass; we report the raw ``log_softmax(logits)``
instead of 0. Every result also carries ``raw_logprobs`` (a :class:`LocalGenResult`):
the unprocessed model log-probs of the same tokens, what a PPO ratio wants when
the rollout used a different temperature.

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

import functools
import logging
from dataclasses import dataclass
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from mosaic.agent.policy import GenRequest, GenResult

log = logging.getLogger(__name__)


def _step_in_chunk(on_step, idx: list[int], rows: list[int], toks: list[int], lps: list[float]):
    """A chunk's step callback: chunk rows → request indices, and the indices to end back to rows."""
    ended = on_step([idx[r] for r in rows], toks, lps)
    if not ended:
        return None
    where = {i: r for r, i in enumerate(idx)}
    return [where[i] for i in ended if i in where]

def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit`` (binary search over slice
    comparisons, which run in C)."""
    hi = min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # a[:lo] == b[:lo] holds; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# on_step(indices, tokens, logprobs) -> indices to end now (they finish as "stop"), or None
StepCallback = Callable[[list[int], list[int], list[float]], Iterable[int] | None]


@dataclass(frozen=True)
class _Sampling:
    temperature: float
    top_p: float
    stop: torch.Tensor  # (K,) end-of-turn ids
    generator: torch.Generator


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

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {self.max_batch_size}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens: must be >= 0, got {self.prefix_cache_tokens}")


def default_stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, ...]:
    """The model's eos id(s) plus ``<|im_end|>`` when the tokenizer has it."""
    ids: set[int] = set()
    for cfg in (model.generation_config, model.config):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
            ids.add(im_end)
    if not ids:
        raise ValueError("no end-of-turn id: pass LocalPolicyConfig(stop_token_ids=...)")
    return tuple(sorted(ids))


def sample_next(logits: torch.Tensor, *, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: (B, V) raw next-token logits.
    Returns:
        tokens (B,), sampling log-probs (B,) under the processed distribution,
        raw log-probs (B,) = ``log_softmax(logits)`` at the sampled tokens.
    """
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)  # (B, V)
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        raw_lp = raw.gather(1, tokens[:, None]).squeeze(1)
        return tokens, raw_lp, raw_lp
    logp = raw if temperature == 1 else torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_lp, order = logp.sort(dim=-1, descending=True)  # (B, V)
        cum = sorted_lp.exp().cumsum(dim=-1)
        # Drop a token when the mass *before* it already reaches top_p (the top one always stays).
        drop_sorted = (cum - sorted_lp.exp()) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    probs = logp.exp()
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
    return (tokens, logp.gather(1, tokens[:, None]).squeeze(1),
            raw.gather(1, tokens[:, None]).squeeze(1))


class _Entry:
    """A session's cached KV: ``kv[layer] = (keys, values)``, each (H_kv, T, D), for ``ids`` (T,)."""

    __slots__ = ("ids", "kv")

    def __init__(self, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.ids, self.kv = ids, kv


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
        self._cache: OrderedDict[str, _Entry] = OrderedDict()  # LRU, oldest first
        self._cached_tokens = 0
        self._weights_version = self._version()
        self.cache_stats = {"hits": 0, "misses": 0, "reused_tokens": 0, "prefilled_tokens": 0,
                            "evictions": 0, "invalidations": 0, "shared_prefill_rows": 0}

    # ---------------------------------------------------------------- protocol
    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Sample one turn for every request; results in request order, never raises on bad input."""
        return self.generate_with(requests)

    def generate_with(self, requests: Sequence[GenRequest], *, temperature: float | None = None,
                      top_p: float | None = None, stop_token_ids: Sequence[int] | None = None,
                      generator: torch.Generator | None = None,
                      on_step: StepCallback | None = None) -> list[GenResult]:
        """:meth:`generate` with per-call sampling overrides (what the server uses).

        ``on_step(indices, tokens, logprobs)`` is called after every decode step with the
        request indices that got a token, the tokens and their sampling log-probs (streaming);
        it may return request indices to end after that token (finish ``stop``: the server's
        stop strings), or None.
        """
        sampling = _Sampling(
            self.config.temperature if temperature is None else temperature,
            self.config.top_p if top_p is None else top_p,
            self._stop if stop_token_ids is None
            else torch.tensor(list(stop_token_ids), dtype=torch.long, device=self.device),
            generator or self.generator)
        self._check_weights()
        results: list[GenResult | None] = [None] * len(requests)
        runnable: list[int] = []
        prefixes: dict[int, tuple[_Entry, int] | None] = {}
        for i, req in enumerate(requests):
            problem = self._check(req)
            if problem is not None:
                results[i] = LocalGenResult([], [], "error", problem, [])
            elif req.max_new_tokens <= 0:
                results[i] = LocalGenResult([], [], "length", None, [])
            else:
                runnable.append(i)
                prefixes[i] = self._lookup(req)
        # Similar amounts of new work together: less padding in each chunk.
        runnable.sort(key=lambda i: len(requests[i].prompt_ids) - (prefixes[i][1] if prefixes[i] else 0))
        step = self.config.max_batch_size
        for start in range(0, len(runnable), step):
            idx = runnable[start:start + step]
            try:
                cb = None if on_step is None else functools.partial(_step_in_chunk, on_step, idx)
                chunk = self._generate_batch([requests[i] for i in idx], sampling, cb,
                                             [prefixes[i] for i in idx])
            except Exception as exc:  # e.g. out of memory: fail these rows, keep the rollout alive
                log.exception("LocalPolicy batch failed")
                for i in idx:
                    self.release(requests[i].session_key)
                chunk = [LocalGenResult([], [], "error", f"{type(exc).__name__}: {exc}", [])
                         for _ in idx]
            for i, res in zip(idx, chunk):
                results[i] = res
        return results  # type: ignore[return-value]

    def release(self, session_key: str) -> None:
        """Drop the session's cached prefix (no-op if none)."""
        entry = self._cache.pop(session_key, None)
        if entry is not None:
            self._cached_tokens -= len(entry.ids)

    def cached_prefix(self, session_key: str) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """``(ids, kv)`` the session's cache holds under the current weights (``kv[layer] = (K, V)``, each
        (H_kv, len(ids), D)), or None (no cache, evicted, or the weights changed since). Read-only: the
        tensors are shared with the cache."""
        self._check_weights()
        entry = self._cache.get(session_key)
        return None if entry is None else (entry.ids, entry.kv)

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

    def _lookup(self, req: GenRequest) -> tuple[_Entry, int] | None:
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

    def _lookup_shared(self, prompt: list[int]) -> tuple[_Entry, int] | None:
        """The cached sequence sharing the longest prefix with ``prompt`` (at most all but its last token)."""
        limit = len(prompt) - 1
        best: tuple[_Entry, int] | None = None
        best_key = None
        for key, entry in self._cache.items():
            n = _common_prefix(entry.ids, prompt, limit)
            if n >= self.config.shared_prefix_min and (best is None or n > best[1]):
                best, best_key = (entry, n), key
        if best is None:
            self.cache_stats["misses"] += 1
            return None
        self._cache.move_to_end(best_key)  # recently used
        self.cache_stats["hits"] += 1
        return best

    def _store(self, key: str, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(ids) > self.config.prefix_cache_tokens:
            return
        self.release(key)
        self._cache[key] = _Entry(ids, kv)
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

    def _prefill(self, reqs: list[GenRequest], prefixes: list[tuple[_Entry, int] | None]):
        """Batched prefill of each prompt's uncached suffix after its cached prefix.

        Row layout along the cache axis: ``[pad][cached prefix c_b][pad][suffix s_b]``: the
        past block is ``P = max c`` wide, the new block ``S = max s``; pads are masked out
        and positions are explicit, so each row sees exactly its own sequence.
        Returns (logits (B, V), cache, mask (B, P + S), next positions (B,)).
        """
        B = len(reqs)
        cached = [p[1] if p else 0 for p in prefixes]
        suffix = [len(r.prompt_ids) - c for r, c in zip(reqs, cached)]
        P, S = max(cached), max(suffix)
        input_ids = torch.full((B, S), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, P + S), dtype=torch.long)
        positions = torch.zeros((B, S), dtype=torch.long)
        for b, r in enumerate(reqs):
            c, s = cached[b], suffix[b]
            input_ids[b, S - s:] = torch.tensor(r.prompt_ids[c:], dtype=torch.long)
            mask[b, P - c:P] = 1
            mask[b, P + S - s:] = 1
            positions[b, S - s:] = torch.arange(c, c + s)
        cache = DynamicCache(config=self.model.config)
        if P > 0:
            ref = next(p for p in prefixes if p)[0].kv
            for layer, (k0, v0) in enumerate(ref):
                H, _, D = k0.shape
                keys = k0.new_zeros((B, H, P, D))
                values = v0.new_zeros((B, v0.shape[0], P, v0.shape[2]))
                for b, pre in enumerate(prefixes):
                    if pre:
                        c = cached[b]
                        keys[b, :, P - c:] = pre[0].kv[layer][0][:, :c]
                        values[b, :, P - c:] = pre[0].kv[layer][1][:, :c]
                cache.update(keys, values, layer)
        self.cache_stats["reused_tokens"] += sum(cached)
        self.cache_stats["prefilled_tokens"] += sum(suffix)
        input_ids, mask, positions = (t.to(self.device) for t in (input_ids, mask, positions))
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        next_pos = torch.tensor([len(r.prompt_ids) for r in reqs], device=self.device)
        return out.logits[:, -1, :], cache, mask, next_pos

    def _prefill_shared(self, reqs: list[GenRequest], prefixes: list[tuple[_Entry, int] | None]):
        """:meth:`_prefill`, with identical uncached prompts (a group's G samples of one task open with the same
        prompt) prefilled once and their rows copied (the sampler still draws each row on its own)."""
        first: dict[tuple[int, ...], int] = {}
        uniq: list[int] = []
        where: list[int] = []
        for b, (r, pre) in enumerate(zip(reqs, prefixes)):
            k = None if pre else tuple(r.prompt_ids)
            if k is not None and k in first:
                where.append(first[k])
                continue
            if k is not None:
                first[k] = len(uniq)
            where.append(len(uniq))
            uniq.append(b)
        if len(uniq) == len(reqs):
            return self._prefill(reqs, prefixes)
        logits, cache, mask, _ = self._prefill([reqs[b] for b in uniq], [prefixes[b] for b in uniq])
        idx = torch.tensor(where, device=self.device)
        cache.batch_select_indices(idx)
        self.cache_stats["shared_prefill_rows"] += len(reqs) - len(uniq)
        next_pos = torch.tensor([len(r.prompt_ids) for r in reqs], device=self.device)
        return logits[idx], cache, mask[idx], next_pos

    @staticmethod
    def _extract(cache: DynamicCache, mask: torch.Tensor, active: list[int], rows: list[int],
                 into: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Copy the valid cache positions of active rows ``active`` (original rows ``rows``)."""
        for a, r in zip(active, rows):
            valid = mask[a].bool()
            into[r] = [(layer.keys[a][:, valid].clone(), layer.values[a][:, valid].clone())
                       for layer in cache.layers]

    @torch.inference_mode()
    def _generate_batch(self, reqs: list[GenRequest], sampling: "_Sampling",
                        on_step: StepCallback | None = None,
                        prefixes: list[tuple[_Entry, int] | None] | None = None) -> list[LocalGenResult]:
        # ~70 lines, kept whole: prefill and the decode loop share the batch's tensors and row bookkeeping.
        B = len(reqs)
        keep_kv = self.config.prefix_cache
        prefixes = prefixes or [None] * B
        logits, cache, mask, next_pos = self._prefill_shared(reqs, prefixes)

        max_new = torch.tensor([self._max_new(r) for r in reqs], device=self.device)
        rows = torch.arange(B, device=self.device)  # original row of each active row
        tokens_out: list[torch.Tensor] = []  # per step: (B_active,)
        rows_out: list[torch.Tensor] = []
        lp_out: list[torch.Tensor] = []
        raw_out: list[torch.Tensor] = []
        finish = ["length"] * B
        kv_rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        step = 0
        while True:
            tok, lp, raw = sample_next(logits, temperature=sampling.temperature,
                                       top_p=sampling.top_p, generator=sampling.generator)
            ended = on_step(rows.tolist(), tok.tolist(), lp.tolist()) if on_step is not None else None
            tokens_out.append(tok)
            rows_out.append(rows)
            lp_out.append(lp)
            raw_out.append(raw)
            step += 1
            stopped = torch.isin(tok, sampling.stop)
            if ended:
                stopped = stopped | torch.isin(rows, torch.tensor(sorted(ended), device=rows.device))
            done = stopped | (max_new[rows] <= step)
            if bool(stopped.any()):
                for r in rows[stopped].tolist():
                    finish[r] = "stop"
            if bool(done.all()):
                if keep_kv:
                    self._extract(cache, mask, list(range(len(rows))), rows.tolist(), kv_rows)
                break
            if bool(done.any()):
                if keep_kv:
                    gone = done.nonzero().squeeze(1)
                    self._extract(cache, mask, gone.tolist(), rows[gone].tolist(), kv_rows)
                keep = (~done).nonzero().squeeze(1)  # (B_active',)
                cache.batch_select_indices(keep)
                rows, tok, mask, next_pos = rows[keep], tok[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask,
                             position_ids=next_pos[:, None], past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

        # Gather per-row sequences on the host once.
        all_rows = torch.cat(rows_out).tolist()
        all_tok = torch.cat(tokens_out).tolist()
        all_lp = torch.cat(lp_out).tolist()
        all_raw = torch.cat(raw_out).tolist()
        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        raws: list[list[float]] = [[] for _ in range(B)]
        for r, t, a, c in zip(all_rows, all_tok, all_lp, all_raw):
            toks[r].append(t)
            lps[r].append(a)
            raws[r].append(c)
        for b, kv in kv_rows.items():  # the last sampled token was never fed: not in the cache
            ids = list(reqs[b].prompt_ids) + toks[b][:-1]
            if kv[0][0].shape[1] == len(ids):
                self._store(reqs[b].session_key, ids, kv)
            else:  # should not happen; never cache a misaligned prefix
                log.warning("prefix cache: %d cached positions for %d ids; not stored",
                            kv[0][0].shape[1], len(ids))
        return [LocalGenResult(toks[b], lps[b], finish[b], None, raws[b])  # type: ignore[arg-type]
                for b in range(B)]
