"""The recording proxy: an OpenAI-compatible server that forwards to an upstream and records every call.

Put it between an agent harness and its model server (vLLM, SGLang, the
project's own server). Each call on ``/v1/chat/completions`` or
``/v1/completions`` (streamed or not) is forwarded with two additions —
``return_token_ids: true`` (vLLM's flag: ``prompt_token_ids`` on the response,
``token_ids`` per choice) and ``logprobs`` — and recorded as a
:class:`~mosaic.capture.records.CallRecord` with the exact prompt and
completion ids. When the upstream returns no ids the proxy tokenizes with the
model's tokenizer (``tokenizer=``) and marks the record ``retokenized``.

The rollout a call belongs to comes from the base URL
(``/rollouts/{id}/v1/...``) or the ``X-Mosaic-Rollout`` header; a call with neither is recorded
under the rollout id ``no-rollout-id`` (:data:`~mosaic.capture.records.NO_ROLLOUT_ID`).
``POST /rollouts/{id}/reward`` attaches the outcome.

Faults: bodies over ``max_body_bytes`` get 413, malformed JSON (or JSON nested
deeper than ``MAX_JSON_DEPTH``) 400, ``max_tokens`` outside [1, 2**31 - 1] 400 (not
forwarded), a wrong schema 422 (OpenAI error objects
with a message). Only a failure to *connect* is retried (``retries`` times, with
backoff): once a request may have reached the upstream it is never sent again,
so a read timeout cannot start a second generation. Each call has one overall
deadline, ``timeout_s`` from its arrival, covering connects, backoff, the
generation and a relayed stream: past it the client gets 504 (or a cut stream).
Upstream errors are passed through and recorded with their status; when the
upstream refuses a prompt as too long for the model's context, the record is
marked ``context_overflow`` and keeps the prompt's ids (from the upstream's
``/tokenize``, as vLLM serves it, else the proxy's tokenizer). The proxy asks
the upstream for ``accept-encoding: identity``: it relays bytes as they come.
Any JSON a client sends is recorded: a call that was answered has exactly one
record. Text is made safe where it enters: a lone surrogate (``"\\udfff"``, no
UTF-8 form) in a request, a reward POST or the upstream's response becomes
U+FFFD (the request is forwarded so) and is counted in the record's
``sanitized_text``, as the harness does. The response body is the upstream's,
unchanged: it carries the extra fields the proxy asked for, which OpenAI
clients ignore.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import math
import os
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
from fastapi import FastAPI, Request  # module level: FastAPI resolves route annotations by name
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from mosaic.agent.tokenizer import load_tokenizer
from mosaic.agent.tools import safe_json
from mosaic.capture.records import NO_ROLLOUT_ID, RECORDS_FILE, CallRecord, RecordWriter, RewardRecord, make_record_safe
from mosaic.capture.wire import (
    MAX_JSON_DEPTH,
    OVERFLOW,
    ApiError,
    StreamAccumulator,
    check_max_tokens,
    check_upstream_fields,
    choice_token_ids,
    error_body,
    json_depth_exceeds,
    logprob_list,
    policy_version,
    retokenize,
    validate_request,
)
from mosaic.serving import run_server

_FORWARD_PARAMS_SKIP = {"messages", "tools", "prompt"}


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


class RecordingProxy:
    """State of one proxy: config, upstream client, records writer, optional tokenizer."""

    def __init__(self, config: ProxyConfig, *, tokenizer: Any = None,
                 accept_rollout: Callable[[str, str], bool] | None = None,
                 force_params: dict[str, Any] | None = None):
        self.cfg = config
        self.tokenizer = tokenizer
        self.accept_rollout = accept_rollout
        self.force_params = dict(force_params or {})
        if tokenizer is None and config.tokenizer:  # the served model's own: no template is guessed
            self.tokenizer = load_tokenizer(config.tokenizer, fallback_template=None)
        self.writer: RecordWriter | None = None
        self.clients: list[Any] = []
        self._seq = itertools.count()
        self._run = f"{int(time.time())}-{uuid.uuid4().hex[:6]}"
        self.in_flight = 0
        self.write_errors = 0
        self.announce = False

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self.writer = RecordWriter(Path(self.cfg.out_dir) / RECORDS_FILE, fsync=self.cfg.fsync)
        # A few shared keep-alive clients, used round-robin: httpcore scans its whole pool on every
        # request, so several small pools cost less CPU per request than one large pool.
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

    async def stop(self) -> None:
        # uvicorn drains in-flight requests before the lifespan ends; wait a little for relays too.
        for _ in range(50):
            if self.in_flight == 0:
                break
            await asyncio.sleep(0.1)
        for client in self.clients:
            await client.aclose()
        if self.writer is not None:
            self.writer.close()
            if self.announce:
                print(f"mosaic proxy: stopped; {self.writer.count} record(s) flushed to {self.writer.path}",
                      file=sys.stderr, flush=True)

    # -- for an in-process owner (the trainer) ---------------------------------------------------
    def record(self, rec) -> None:
        """Append a record (a trainer-scored :class:`RewardRecord`) to this proxy's records file."""
        if self.writer is None:
            raise RuntimeError("the proxy has not started: no records file yet")
        self.writer.write(rec)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block (from another thread than the proxy's) until no call is in flight, so every answered call
        is recorded (a streamed call's record lands after its last byte); False when ``timeout`` ran out."""
        t_end = time.monotonic() + timeout
        while self.in_flight > 0:
            if time.monotonic() >= t_end:
                return False
            time.sleep(0.02)
        return True

    # -- helpers -------------------------------------------------------------------------------
    def _upstream_headers(self, request) -> dict[str, str]:
        # identity: the proxy relays the upstream's bytes as they come and parses them on the way
        h = {"content-type": "application/json", "accept-encoding": "identity"}
        if self.cfg.upstream_api_key:
            h["authorization"] = f"Bearer {self.cfg.upstream_api_key}"
        elif self.cfg.api_key is None and request.headers.get("authorization"):
            h["authorization"] = request.headers["authorization"]
        return h

    def check_auth(self, request) -> None:
        if self.cfg.api_key is None:
            return
        got = request.headers.get("authorization", "").encode("latin-1")  # the header's bytes, as sent
        if not hmac.compare_digest(got, f"Bearer {self.cfg.api_key}".encode()):  # constant time, like serve's
            raise ApiError(401, "missing or wrong bearer token", "authentication_error")

    async def read_json(self, request) -> Any:
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.cfg.max_body_bytes:
            raise ApiError(413, f"request body of {cl} bytes exceeds the limit of {self.cfg.max_body_bytes}")
        chunks, n = [], 0
        try:
            async for chunk in request.stream():
                n += len(chunk)
                if n > self.cfg.max_body_bytes:
                    raise ApiError(413, f"request body exceeds the limit of {self.cfg.max_body_bytes} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(400, "client disconnected while sending the request") from None
        too_deep = ApiError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
        try:
            body = json.loads(b"".join(chunks))
        except RecursionError:
            raise too_deep from None
        except ValueError as exc:  # bad JSON, bad UTF-8, an integer of more than 4,300 digits
            raise ApiError(400, f"request body is not valid JSON: {str(exc)[:200]}") from None
        if json_depth_exceeds(body, MAX_JSON_DEPTH):
            raise too_deep
        return body

    async def _send(self, method: str, path: str, content: bytes | None, headers: dict[str, str], stream: bool,
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
                client = next(self._rr)
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

    def _retokenize(self, rec: CallRecord) -> None:
        retokenize(rec, self.tokenizer)

    def _finish(self, rec: CallRecord) -> None:
        """Complete and write a call's record; never raises (a call that was answered is recorded)."""
        try:
            check_upstream_fields(rec)
            if rec.error is None and (not rec.prompt_ids or (not rec.completion_ids and rec.text)):
                rec.prompt_ids, rec.completion_ids = list(rec.prompt_ids or []), list(rec.completion_ids or [])
                self._retokenize(rec)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the record says so
            rec.error = f"recording failed: {type(exc).__name__}: {exc}"
        make_record_safe(rec)  # the response's texts (the request's were made safe on arrival)
        rec.t_end = time.time()
        try:
            self.writer.write(rec)
        except Exception as exc:  # noqa: BLE001 - keep the call, with what can surely be written
            self.write_errors += 1
            bare = CallRecord(call_id=rec.call_id, rollout_id=rec.rollout_id, seq=rec.seq, endpoint=rec.endpoint,
                              status=rec.status, stream=rec.stream, t_start=rec.t_start, t_end=rec.t_end,
                              error=f"record could not be written whole: {type(exc).__name__}: {exc}"[:500])
            self.writer.write(bare)

    async def _overflow_prompt(self, rec: CallRecord, body: dict, headers: dict[str, str], deadline: float) -> None:
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
        if self.tokenizer is not None:
            keep = (rec.text, rec.completion_ids, rec.error)
            try:
                retokenize(rec, self.tokenizer)
            except Exception:  # noqa: BLE001 - a template that cannot render it: no ids, said so
                rec.prompt_ids = []
            rec.text, rec.completion_ids, rec.error = keep

    # -- the call path -------------------------------------------------------------------------
    async def handle_call(self, request, endpoint: str, rollout_id: str | None):
        # ~80 lines, kept whole: the streamed relay below closes over this call's record and response.
        t_start = time.time()
        self.check_auth(request)
        body, n_safe = safe_json(await self.read_json(request))
        validate_request(endpoint, body)
        check_max_tokens(body)
        rid = rollout_id if rollout_id is not None else request.headers.get("x-mosaic-rollout", "").strip()
        rid = rid or NO_ROLLOUT_ID
        self._check_rollout(rid, "calls")
        seq = next(self._seq)
        rec = CallRecord(
            call_id=f"{self._run}-{seq}", rollout_id=rid, seq=seq, endpoint=endpoint,
            model=str(body.get("model", "")),
            messages=body.get("messages") or [] if endpoint == "chat" else [],
            tools=body.get("tools") or [] if endpoint == "chat" else [],
            prompt=(body["prompt"][0] if isinstance(body.get("prompt"), list) else body.get("prompt"))
            if endpoint == "completions" else None,
            request_params={k: v for k, v in body.items() if k not in _FORWARD_PARAMS_SKIP},
            stream=bool(body.get("stream")), t_start=t_start,
            headers={k: v for k, v in request.headers.items() if k.startswith("x-mosaic-")},
            sanitized_text=n_safe,
        )
        fwd = {**body, **self.force_params}
        if self.cfg.request_token_ids:
            fwd["return_token_ids"] = True
        if endpoint == "chat":
            fwd["logprobs"] = True
        elif fwd.get("logprobs") is None:
            fwd["logprobs"] = 0
        content = json.dumps(fwd).encode()
        headers = self._upstream_headers(request)
        path = "/chat/completions" if endpoint == "chat" else "/completions"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.timeout_s
        self.in_flight += 1
        relaying = False
        try:
            try:
                resp = await self._send("POST", path, content, headers, stream=rec.stream, deadline=deadline)
                rec.t_first = time.time()
                if resp.status_code >= 400 or not rec.stream:
                    if rec.stream:
                        try:
                            data = await asyncio.wait_for(resp.aread(), max(0.001, deadline - loop.time()))
                        except (asyncio.TimeoutError, httpx.HTTPError) as exc:
                            raise ApiError(504 if isinstance(exc, asyncio.TimeoutError) else 502,
                                           f"upstream error body could not be read: {type(exc).__name__}",
                                           "upstream_error") from None
                        finally:
                            await resp.aclose()
                    else:
                        data = resp.content
            except ApiError as exc:
                rec.status, rec.error = exc.status, exc.message
                rec.upstream_s = time.time() - t_start
                self._finish(rec)
                raise
            if resp.status_code >= 400 or not rec.stream:
                rec.upstream_s = time.time() - t_start
                rec.status = resp.status_code
                if resp.status_code >= 400:
                    said = data[:2000].decode("utf-8", "replace")
                    rec.error = f"upstream returned {resp.status_code}: {said[:500]}"
                    if resp.status_code in (400, 413, 422) and OVERFLOW.search(said):
                        await self._overflow_prompt(rec, body, headers, deadline)
                else:
                    self._parse_full(rec, data)
                self._finish(rec)
                return Response(content=data, status_code=resp.status_code,
                                media_type=resp.headers.get("content-type", "application/json"))
            relaying = True
        finally:
            if not relaying:
                self.in_flight -= 1

        acc = StreamAccumulator(endpoint)

        async def relay():
            try:
                async with asyncio.timeout_at(deadline):
                    async for chunk in resp.aiter_raw():
                        acc.feed(chunk)
                        yield chunk
            except TimeoutError:
                rec.error = f"stream cut at the call's deadline ({self.cfg.timeout_s:g} s)"
            except Exception as exc:  # upstream broke mid-stream: the client sees a cut stream
                rec.error = f"upstream stream failed: {type(exc).__name__}: {exc}"
            finally:
                try:
                    await resp.aclose()
                    acc.close()
                    rec.upstream_s = time.time() - t_start
                    if rec.error is None and not acc.done and acc.finish is None:
                        rec.error = "stream ended before the last chunk (client disconnected or upstream cut it)"
                    rec.text = "".join(acc.text)
                    rec.tool_calls = [acc.tool_calls[k] for k in sorted(acc.tool_calls)]
                    rec.finish_reason = acc.finish
                    rec.prompt_ids = acc.prompt_ids or []
                    rec.completion_ids = acc.ids
                    rec.logprobs = acc.logprobs
                    rec.policy_version = acc.policy_version
                finally:
                    self._finish(rec)
                    self.in_flight -= 1

        return StreamingResponse(relay(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type", "text/event-stream"))

    def _parse_full(self, rec: CallRecord, data: bytes) -> None:
        try:
            self._read_completion(rec, data)
        except Exception as exc:  # noqa: BLE001 - whatever the upstream sent, the record says so
            rec.error = f"upstream response is not a completion object: {type(exc).__name__}: {exc}"

    def _read_completion(self, rec: CallRecord, data: bytes) -> None:
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

    def _check_rollout(self, rollout_id: str, what: str) -> None:
        """With ``accept_rollout`` (a trainer's proxy): a rollout id it did not hand out is a 404."""
        if self.accept_rollout is not None and not self.accept_rollout(rollout_id, what):
            raise ApiError(404, f"unknown rollout id {rollout_id!r}: use the base URL this rollout was given",
                           "not_found_error")

    async def handle_reward(self, request, rollout_id: str):
        self.check_auth(request)
        self._check_rollout(rollout_id, "rewards")
        body, n_safe = safe_json(await self.read_json(request))
        if not isinstance(body, dict):
            raise ApiError(422, "reward body must be a JSON object")
        r = body.get("reward")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0 <= r <= 1:
            raise ApiError(422, f"field 'reward': {r!r} must be a number in [0, 1]")
        for k in ("ground_truth", "answer", "task_id", "group_id"):
            if body.get(k) is not None and not isinstance(body[k], str):
                raise ApiError(422, f"field {k!r} must be a string")
        meta = body.get("meta") or {}
        if not isinstance(meta, dict):
            raise ApiError(422, "field 'meta' must be an object")
        rec = RewardRecord(rollout_id=rollout_id, reward=float(r), ground_truth=body.get("ground_truth"),
                           answer=body.get("answer"), task_id=body.get("task_id"), group_id=body.get("group_id"),
                           t=time.time(), meta=meta, sanitized_text=n_safe)
        self.writer.write(rec)
        return {"ok": True, "rollout_id": rollout_id}

    async def handle_get(self, request, path: str):
        self.check_auth(request)
        deadline = asyncio.get_running_loop().time() + self.cfg.timeout_s
        resp = await self._send("GET", path, None, self._upstream_headers(request), stream=False, deadline=deadline)
        return Response(content=resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))


def create_proxy_app(config: ProxyConfig, *, tokenizer: Any = None,
                     accept_rollout: Callable[[str, str], bool] | None = None,
                     force_params: dict[str, Any] | None = None):
    """The FastAPI app of a recording proxy (records go to ``config.out_dir/records.jsonl``).

    ``accept_rollout(rollout_id, what)``: when given, calls and rewards for a rollout id it refuses get
    404 (a trainer accepts only the ids of its step). ``force_params``: request fields set on every
    forwarded call whatever the client sent (a trainer's sampling temperature and top-p).
    """
    proxy = RecordingProxy(config, tokenizer=tokenizer, accept_rollout=accept_rollout, force_params=force_params)

    @asynccontextmanager
    async def lifespan(app):
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    app = FastAPI(title="mosaic recording proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(error_body(exc.status, exc.message, exc.kind), status_code=exc.status)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy.handle_call(request, "chat", None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy.handle_call(request, "completions", None)

    @app.post("/rollouts/{rollout_id}/v1/chat/completions")
    async def chat_r(rollout_id: str, request: Request):
        return await proxy.handle_call(request, "chat", rollout_id)

    @app.post("/rollouts/{rollout_id}/v1/completions")
    async def completions_r(rollout_id: str, request: Request):
        return await proxy.handle_call(request, "completions", rollout_id)

    @app.post("/rollouts/{rollout_id}/reward")
    async def reward(rollout_id: str, request: Request):
        return await proxy.handle_reward(request, rollout_id)

    @app.get("/v1/models")
    async def models(request: Request):
        return await proxy.handle_get(request, "/models")

    @app.get("/rollouts/{rollout_id}/v1/models")
    async def models_r(rollout_id: str, request: Request):
        return await proxy.handle_get(request, "/models")

    @app.get("/healthz")
    async def health():
        return {"ok": True, "records": proxy.writer.count if proxy.writer else 0, "in_flight": proxy.in_flight,
                "write_errors": proxy.write_errors}

    return app


def serve(config: ProxyConfig, *, log_level: str = "warning") -> None:
    """Run the proxy in the foreground until SIGINT / SIGTERM (records are flushed on the way out).

    Announces its address on stderr once bound (``port=0`` picks a free port).
    """
    os.makedirs(config.out_dir, exist_ok=True)
    app = create_proxy_app(config)
    app.state.proxy.announce = True
    announce = (f"mosaic proxy: listening on {{url}} -> {config.upstream_v1}; "
                f"records in {Path(config.out_dir) / RECORDS_FILE}")
    run_server(app, host=config.host, port=config.port, announce=announce, log_level=log_level,
               timeout_graceful_shutdown=30, timeout_keep_alive=75, backlog=2048)
