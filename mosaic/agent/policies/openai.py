"""The :class:`~mosaic.agent.policy.Policy` protocol over any OpenAI-compatible server.

Works with vLLM (>= 0.10.2, for ``return_token_ids``), SGLang's OpenAI endpoint and
``mosaic serve``. Token-in, token-out: each request's ``prompt_ids`` are sent as a
token-id ``prompt`` to ``/v1/completions`` (no chat template, no re-tokenisation),
with ``return_token_ids: true`` and ``logprobs: 0``; the reply's ``token_ids`` and
``logprobs.token_logprobs`` become the :class:`GenResult`. A server that echoes
``prompt_token_ids`` different from what was sent is reported as an error, not trusted.

Concurrency: :meth:`OpenAIPolicy.generate` is synchronous, but the requests run
concurrently on a private event loop (one background thread, one
``httpx.AsyncClient`` with connection pooling), at most ``max_concurrency`` in flight.

Failures never raise: connection errors, timeouts, 429 and 5xx are retried
``max_retries`` times with exponential backoff; what still fails (or a 4xx, which
is not retried) becomes ``GenResult(finish_reason="error", error=...)``.

Replies are not trusted: every reply is checked (ids are integers in
``[0, vocab_size)`` when the vocabulary size is known, else ``[0, 2**31)``; no more ids
than ``max_new_tokens``; as many log-probs as ids, each finite and ``<= 0`` up to a
tiny tolerance). A reply that fails becomes an error result of its trajectory (the
harness ends it as ``policy_error`` with the reason) and is counted in
:attr:`OpenAIPolicy.stats` and in that trajectory's ``meta["policy"]``.

Log-probs are whatever the server reports: vLLM's default is the raw model log-probs
(before temperature / top-p); ``mosaic serve`` reports the processed sampling
distribution (identical at temperature 1, top-p 1, the training default).
"""

from __future__ import annotations

import asyncio
import logging
import random
import math
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import httpx

from mosaic.agent.policy import GenRequest, GenResult
from mosaic.trace.graph import LOGPROB_TOLERANCE, MAX_TOKEN_ID

log = logging.getLogger(__name__)

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class OpenAIPolicyConfig:
    """Where the server is and how to sample from it."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """Server root, with or without the trailing ``/v1``."""
    model: str | None = None
    """Model id to request; ``None``: the first id listed by ``GET /v1/models``."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer ...`` when set (local servers need none)."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    stop_token_ids: tuple[int, ...] = ()
    """End-of-turn ids beyond the model's eos (e.g. ``<|im_end|>`` when eos differs)."""
    max_concurrency: int = 32
    """Most requests in flight at once."""
    timeout_s: float = 300.0
    """Per-request read timeout (a long turn on a busy server takes a while)."""
    connect_timeout_s: float = 5.0
    """Connection timeout."""
    max_retries: int = 3
    """Retries after the first attempt for transient failures (total attempts = 1 + this)."""
    backoff_s: float = 0.5
    """First retry delay; doubles each retry, with +-25 % jitter, capped at ``backoff_max_s``."""
    backoff_max_s: float = 8.0
    """Longest retry delay."""
    extra_body: Mapping[str, Any] | None = None
    """Extra JSON fields for every request (e.g. ``{"seed": 0}``, SGLang options)."""
    vocab_size: int | None = None
    """The model's vocabulary size: reply ids must be below it (None: only ``[0, 2**31)`` is checked)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {self.max_retries}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeout_s / connect_timeout_s: must be > 0")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1, got {self.vocab_size}")


class _Permanent(Exception):
    """A failure retrying cannot fix (4xx, malformed reply)."""


class _InvalidReply(_Permanent):
    """A well-formed reply whose content is impossible (ids out of range, too long, bad log-probs)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"invalid reply ({kind}): {detail}")
        self.kind = kind


class OpenAIPolicy:
    """Batched turn sampling through an OpenAI-compatible ``/v1/completions`` endpoint."""

    def __init__(self, config: OpenAIPolicyConfig | None = None, **overrides: Any) -> None:
        """``OpenAIPolicy(OpenAIPolicyConfig(...))`` or ``OpenAIPolicy(base_url=..., ...)``."""
        if config is None:
            config = OpenAIPolicyConfig(**overrides)
        elif overrides:
            raise TypeError("pass either a config or keyword overrides, not both")
        self.config = config
        root = config.base_url.rstrip("/")
        self.base_url = root if root.endswith("/v1") else root + "/v1"
        self._model = config.model
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mosaic-openai-policy",
                                        daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        """``invalid_replies`` and ``invalid_reply/<kind>`` counts (kinds: ``token_ids``, ``length``,
        ``logprobs``, ``count``) over the policy's life."""
        self._invalid_by_traj: dict[str, list[str]] = {}

    def trajectory_meta(self, traj_id: str) -> dict[str, Any] | None:
        """The harness's per-trajectory hook: the invalid replies this trajectory received, if any."""
        with self._lock:
            reasons = self._invalid_by_traj.pop(traj_id, None)
        return {"invalid_replies": len(reasons), "invalid_reply_reasons": reasons} if reasons else None

    # ---------------------------------------------------------------- protocol
    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Sample one turn per request concurrently; results in request order; never raises."""
        if self._closed:
            return [GenResult([], [], "error", "policy is closed") for _ in requests]
        if not requests:
            return []
        future = asyncio.run_coroutine_threadsafe(self._generate_all(list(requests)), self._loop)
        return future.result()

    def release(self, session_key: str) -> None:
        """Stateless client: nothing to free (servers cache prefixes on their own)."""

    def close(self) -> None:
        """Close the HTTP client and stop the background loop (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "OpenAIPolicy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals
    def _client_or_new(self) -> httpx.AsyncClient:
        if self._client is None:
            cfg = self.config
            headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
            self._client = httpx.AsyncClient(
                base_url=self.base_url, headers=headers,
                timeout=httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s),
                limits=httpx.Limits(max_connections=cfg.max_concurrency,
                                    max_keepalive_connections=cfg.max_concurrency))
        return self._client

    async def _generate_all(self, requests: list[GenRequest]) -> list[GenResult]:
        sem = asyncio.Semaphore(self.config.max_concurrency)

        async def one(req: GenRequest) -> GenResult:
            async with sem:
                return await self._generate_one(req)

        return list(await asyncio.gather(*(one(r) for r in requests)))

    async def _model_name(self) -> str:
        if self._model is None:
            data = await self._with_retries(lambda: self._get_json("/models"))
            try:
                self._model = data["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise _Permanent(f"GET /models: no model listed in {str(data)[:200]}") from None
        return self._model

    async def _get_json(self, path: str) -> Any:
        resp = await self._client_or_new().get(path)
        return self._check(resp, path)

    async def _post_json(self, path: str, body: dict) -> Any:
        resp = await self._client_or_new().post(path, json=body)
        return self._check(resp, path)

    @staticmethod
    def _check(resp: httpx.Response, path: str) -> Any:
        if resp.status_code in _RETRY_STATUS:
            raise httpx.HTTPStatusError(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}",
                                        request=resp.request, response=resp)
        if resp.status_code >= 400:
            raise _Permanent(f"{path}: HTTP {resp.status_code}: {resp.text[:500]}")
        try:
            return resp.json()
        except ValueError:
            raise _Permanent(f"{path}: reply is not JSON: {resp.text[:200]}") from None

    async def _with_retries(self, call):
        cfg = self.config
        delay = cfg.backoff_s
        for attempt in range(cfg.max_retries + 1):
            try:
                return await call()
            except _Permanent:
                raise
            except (httpx.TransportError, httpx.HTTPStatusError) as exc:
                if attempt == cfg.max_retries:
                    raise _Permanent(f"gave up after {attempt + 1} attempts: "
                                     f"{type(exc).__name__}: {exc}") from exc
                log.warning("OpenAIPolicy: %s: %s; retry %d/%d in %.2fs", type(exc).__name__,
                            exc, attempt + 1, cfg.max_retries, delay)
                await asyncio.sleep(delay * random.uniform(0.75, 1.25))
                delay = min(delay * 2, cfg.backoff_max_s)
        raise AssertionError("unreachable")

    async def _generate_one(self, req: GenRequest) -> GenResult:
        if req.max_new_tokens <= 0:
            return GenResult([], [], "length")
        if not req.prompt_ids:
            return GenResult([], [], "error", "empty prompt_ids")
        cfg = self.config
        try:
            body: dict[str, Any] = {
                "model": await self._model_name(),
                "prompt": list(req.prompt_ids),
                "max_tokens": req.max_new_tokens,
                "temperature": cfg.temperature,
                "top_p": cfg.top_p,
                "logprobs": 0,
                "return_token_ids": True,
                "skip_special_tokens": False,
                "stream": False,
            }
            if cfg.stop_token_ids:
                body["stop_token_ids"] = list(cfg.stop_token_ids)
            if cfg.extra_body:
                body.update(cfg.extra_body)
            data = await self._with_retries(lambda: self._post_json("/completions", body))
            return self._parse(req, data, self.config.vocab_size)
        except _InvalidReply as exc:
            with self._lock:
                self.stats["invalid_replies"] += 1
                self.stats[f"invalid_reply/{exc.kind}"] += 1
                traj = (req.meta or {}).get("traj_id")
                if traj is not None:
                    self._invalid_by_traj.setdefault(str(traj), []).append(str(exc))
            log.warning("OpenAIPolicy: %s (session %s)", exc, req.session_key)
            return GenResult([], [], "error", str(exc))
        except _Permanent as exc:
            return GenResult([], [], "error", str(exc))
        except Exception as exc:  # never crash a rollout
            log.exception("OpenAIPolicy: unexpected failure")
            return GenResult([], [], "error", f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _parse(req: GenRequest, data: Any, vocab_size: int | None = None) -> GenResult:
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise _Permanent(f"reply has no choices: {str(data)[:300]}") from None
        prompt_echo = choice.get("prompt_token_ids", data.get("prompt_token_ids"))
        if prompt_echo is not None and list(prompt_echo) != list(req.prompt_ids):
            raise _Permanent("server's prompt_token_ids differ from the ids sent "
                             "(it re-tokenised the prompt?)")
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:  # vLLM with return_tokens_as_token_ids: tokens are "token_id:N"
            toks = lp.get("tokens") or []
            if toks and all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
                ids = [int(t.split(":", 1)[1]) for t in toks]
            else:
                raise _Permanent("reply has no token_ids (server must support return_token_ids)")
        logprobs = lp.get("token_logprobs")
        if not isinstance(ids, list) or not isinstance(logprobs, list) or len(logprobs) != len(ids):
            n_ids = len(ids) if isinstance(ids, list) else repr(ids)[:20]
            n_lp = len(logprobs) if isinstance(logprobs, list) else repr(logprobs)[:20]
            raise _InvalidReply("count", f"reply has {n_lp} logprobs for {n_ids} tokens")
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            return GenResult([], [], "error", f"finish_reason {finish!r}")
        _check_reply(req, ids, logprobs, vocab_size)
        return GenResult([int(t) for t in ids], [float(x) for x in logprobs], finish)


def _check_reply(req: GenRequest, ids: Any, logprobs: Any, vocab_size: int | None) -> None:
    """Raise :class:`_InvalidReply` naming the first impossible thing in a reply."""
    if not isinstance(ids, list) or not isinstance(logprobs, list):
        raise _InvalidReply("token_ids", "token_ids / token_logprobs must be lists")
    if len(ids) > req.max_new_tokens:
        raise _InvalidReply("length", f"{len(ids)} tokens for a turn capped at {req.max_new_tokens}")
    if len(logprobs) != len(ids):
        raise _InvalidReply("count", f"{len(logprobs)} logprobs for {len(ids)} tokens")
    top = vocab_size - 1 if vocab_size is not None else MAX_TOKEN_ID
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= top:
            raise _InvalidReply("token_ids", f"token id {t!r} at position {i} is outside [0, {top}]"
                                + (" (the vocabulary)" if vocab_size is not None else ""))
    for i, x in enumerate(logprobs):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not -math.inf < x <= LOGPROB_TOLERANCE:
            raise _InvalidReply("logprobs", f"log-prob {x!r} at position {i} is not finite and <= 0")
