"""The recording proxy's settings (:class:`ProxyConfig`) and its side towards the upstream: the shared
keep-alive clients, a send that retries only failures to connect within one deadline, the ids of a
prompt the upstream refused as too long, and a full (non-streamed) completion read into a record.
The call path itself is in :mod:`mosaic.capture.proxy`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from typing import Any

import httpx

from mosaic.capture.records import CallRecord
from mosaic.capture.wire import ApiError, choice_token_ids, logprob_list, policy_version, retokenize


@dataclass(frozen=True)
class ProxyConfig:
    """Settings of the recording proxy.

    Attributes:
        upstream: base URL of the model server, with or without the trailing ``/v1``.
        out_dir: directory the records file (``records.jsonl``) is appended to.
        host: interface to bind; loopback by default (the proxy has no TLS).
        port: TCP port.
        api_key: bearer token clients must send (``Authorization: Bearer ...``); None = open.
        upstream_api_key: bearer token sent to the upstream; None forwards the client's
            ``Authorization`` header when ``api_key`` is None, and sends none otherwise.
        max_body_bytes: largest request body accepted (413 above).
        timeout_s: one overall deadline per call, from its arrival: connects, retries, the
            generation and a relayed stream (504, or a cut stream, past it).
        connect_timeout_s: upstream connect timeout per attempt.
        retries: extra attempts after a failure to connect (a request that may have reached the
            upstream is never re-sent) before 502 / 504.
        retry_backoff_s: wait before the first retry, doubled each time.
        request_token_ids: add ``return_token_ids: true`` to forwarded requests (vLLM);
            turn off for an upstream that rejects unknown fields (then use ``tokenizer``).
        tokenizer: directory of the model's tokenizer, for upstreams that return no ids.
        max_connections: total size of the shared keep-alive pools to the upstream.
        pool_shards: number of shared upstream clients the pool is split over (round-robin).
        fsync: force each record to disk (survives power loss; slower).
    """

    upstream: str
    out_dir: str
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str | None = None
    upstream_api_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    retries: int = 2
    retry_backoff_s: float = 0.25
    request_token_ids: bool = True
    tokenizer: str | None = None
    max_connections: int = 256
    pool_shards: int = 8
    fsync: bool = False

    def __post_init__(self) -> None:
        if not self.upstream.startswith(("http://", "https://")):
            raise ValueError(f"upstream: {self.upstream!r} must be an http(s) URL")
        if not self.out_dir:
            raise ValueError("out_dir: a directory for the records is required")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a TCP port")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes: {self.max_body_bytes} must be positive")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeout_s / connect_timeout_s: must be positive")
        if self.retries < 0 or self.retries > 10:
            raise ValueError(f"retries: {self.retries} must be in [0, 10] (retries are bounded)")
        if self.max_connections < 1:
            raise ValueError("max_connections: must be at least 1")
        if not 1 <= self.pool_shards <= self.max_connections:
            raise ValueError(f"pool_shards: {self.pool_shards} must be in [1, max_connections]")

    @property
    def upstream_v1(self) -> str:
        base = self.upstream.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"

    @property
    def upstream_root(self) -> str:
        """The upstream's base URL without ``/v1`` (where vLLM serves ``/tokenize``)."""
        return self.upstream_v1[: -len("/v1")]


class UpstreamPool:
    """A few shared keep-alive clients to the upstream, used round-robin: httpcore scans its whole pool
    on every request, so several small pools cost less CPU per request than one large pool.

    ``app``: the upstream's own ASGI app, when the process that embeds the proxy also serves the model (a
    trainer, :mod:`mosaic.train.external`). Whole (non-streamed) calls then reach it in the proxy's event
    loop, with no socket, HTTP parsing or second event loop between them (about 10 ms less per call on
    a busy 2-core machine); streamed calls still go over HTTP, because httpx's ASGI transport hands over a
    response only once it is complete.
    """

    def __init__(self, cfg: ProxyConfig, app: Any = None):
        self.cfg = cfg
        self.app = app
        self.clients: list[Any] = []
        self.local: Any = None  # the client through ``app`` (None: every call over HTTP)

    def open(self) -> None:
        per = max(1, -(-self.cfg.max_connections // self.cfg.pool_shards))
        self.clients = [
            httpx.AsyncClient(
                base_url=self.cfg.upstream_v1,
                timeout=httpx.Timeout(self.cfg.timeout_s, connect=self.cfg.connect_timeout_s),
                # Idle upstream connections expire before a typical server's 5 s keep-alive does,
                # so the proxy never sends on a connection the upstream is closing.
                limits=httpx.Limits(max_connections=per, max_keepalive_connections=per, keepalive_expiry=2.0),
            )
            for _ in range(self.cfg.pool_shards)
        ]
        self._rr = itertools.cycle(self.clients)
        if self.app is not None:
            self.local = httpx.AsyncClient(base_url=self.cfg.upstream_v1, timeout=httpx.Timeout(self.cfg.timeout_s),
                                           transport=httpx.ASGITransport(app=self.app, raise_app_exceptions=False))

    async def close(self) -> None:
        for client in self.clients + ([self.local] if self.local is not None else []):
            await client.aclose()

    async def send(self, method: str, path: str, content: bytes | None, headers: dict[str, str], stream: bool,
                    deadline: float):
        """Send once, retrying only failures to connect (the request never left), with backoff, all
        within ``deadline`` (event-loop time); raise ApiError 502 / 504."""
        loop = asyncio.get_running_loop()
        delay = self.cfg.retry_backoff_s
        attempts = 0
        last: Exception | None = None
        while attempts <= self.cfg.retries:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            attempts += 1
            try:
                client = self.local if self.local is not None and not stream else next(self._rr)
                req = client.build_request(method, path, content=content, headers=headers)
                return await asyncio.wait_for(client.send(req, stream=stream), remaining)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                last = exc  # nothing reached the upstream: safe to try again
            except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
                raise ApiError(504, f"upstream timed out ({type(exc).__name__}) after {attempts} attempt(s); "
                                    "a request that may have reached the upstream is not re-sent",
                               "upstream_timeout") from None
            except httpx.HTTPError as exc:
                raise ApiError(502, f"upstream failed after the request was sent: {type(exc).__name__}: {exc}",
                               "upstream_error") from None
            if attempts <= self.cfg.retries:
                await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))
                delay *= 2
        if last is None or isinstance(last, httpx.TimeoutException):
            raise ApiError(504, f"upstream timed out after {attempts} attempt(s) "
                                f"({type(last).__name__ if last else 'deadline'})", "upstream_timeout")
        raise ApiError(502, f"upstream unreachable after {attempts} attempt(s): "
                            f"{type(last).__name__}: {last}", "upstream_error")

    async def overflow_prompt(self, rec: CallRecord, body: dict, headers: dict[str, str], deadline: float,
                              tokenizer: Any) -> None:
        """A prompt the upstream refused as too long: its ids from the upstream's ``/tokenize`` (vLLM's
        route, with the server's own chat template), else from the proxy's tokenizer."""
        rec.context_overflow = True
        loop = asyncio.get_running_loop()
        payload: dict[str, Any] = {"model": body.get("model")}
        if rec.endpoint == "chat":
            payload.update(messages=body.get("messages"), add_generation_prompt=True)
            if body.get("tools"):
                payload["tools"] = body["tools"]
        else:
            payload["prompt"] = rec.prompt
        try:
            remaining = min(10.0, deadline - loop.time())
            if remaining > 0:
                r = await asyncio.wait_for(
                    self.clients[0].post(self.cfg.upstream_root + "/tokenize", content=json.dumps(payload).encode(),
                                         headers=headers), remaining)
                ids = r.json().get("tokens") if r.status_code == 200 else None
                if isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < 2**31 for t in ids):
                    rec.prompt_ids = ids
                    return
        except (httpx.HTTPError, asyncio.TimeoutError, ValueError, AttributeError):
            pass
        if tokenizer is not None:
            keep = (rec.text, rec.completion_ids, rec.error)
            try:
                retokenize(rec, tokenizer)
            except Exception:  # noqa: BLE001 - a template that cannot render it: no ids, said so
                rec.prompt_ids = []
            rec.text, rec.completion_ids, rec.error = keep


def read_completion(rec: CallRecord, data: bytes) -> None:
    """A full (non-streamed) completion object's fields into the record (raises on a malformed one)."""
    obj = json.loads(data)
    rec.policy_version = policy_version(obj)
    ch = (obj.get("choices") or [{}])[0]
    rec.finish_reason = ch.get("finish_reason")
    if rec.endpoint == "chat":
        msg = ch.get("message") or {}
        c = msg.get("content")
        rec.text = c if isinstance(c, str) else ""
        rec.tool_calls = msg.get("tool_calls") or []
    else:
        rec.text = ch.get("text") or ""
    rec.prompt_ids = obj.get("prompt_token_ids") or ch.get("prompt_token_ids") or []
    rec.completion_ids = choice_token_ids(ch) or []
    rec.logprobs = logprob_list(rec.endpoint, ch.get("logprobs"))

