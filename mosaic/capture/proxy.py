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
deeper than ``MAX_JSON_DEPTH``) 400, ``max_tokens`` outside [1, 2**31 - 1] or a sampling number
that is NaN, infinite or out of range (``temperature`` < 0, ``top_p`` > 1) 400 (not forwarded), a wrong schema 422 (OpenAI error objects
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
from pathlib import Path
from typing import Any, Callable

import httpx
from fastapi import FastAPI, Request  # module level: FastAPI resolves route annotations by name
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from mosaic.agent.tokenizer import load_tokenizer
from mosaic.agent.tools import safe_json
from mosaic.capture.records import (NO_ROLLOUT_ID, RECORDS_FILE, CallRecord, RecordError, RecordWriter,
                                    RewardRecord, make_record_safe)
from mosaic.capture.upstream import ProxyConfig, UpstreamPool, read_completion
from mosaic.capture.wire import (
    MAX_JSON_DEPTH,
    OVERFLOW,
    ApiError,
    StreamAccumulator,
    check_finite,
    check_max_tokens,
    check_sampling,
    check_upstream_fields,
    error_body,
    json_depth_exceeds,
    retokenize,
    validate_request,
)
from mosaic.serving import run_server

_FORWARD_PARAMS_SKIP = {"messages", "tools", "prompt"}

__all__ = ["ProxyConfig", "RecordingProxy", "create_proxy_app", "serve"]  # ProxyConfig: its public path


class RecordingProxy:
    """State of one proxy: config, upstream client, records writer, optional tokenizer."""

    def __init__(self, config: ProxyConfig, *, tokenizer: Any = None,
                 accept_rollout: Callable[[str, str], bool] | None = None,
                 force_params: dict[str, Any] | None = None, upstream_app: Any = None):
        self.cfg = config
        self.tokenizer = tokenizer
        self.accept_rollout = accept_rollout
        self.force_params = dict(force_params or {})
        if tokenizer is None and config.tokenizer:  # the served model's own: no template is guessed
            self.tokenizer = load_tokenizer(config.tokenizer, fallback_template=None)
        self.writer: RecordWriter | None = None
        self.upstream = UpstreamPool(config, upstream_app)
        self._seq = itertools.count()
        self._run = f"{int(time.time())}-{uuid.uuid4().hex[:6]}"
        self.in_flight = 0
        self.write_errors = 0
        self.announce = False

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self.writer = RecordWriter(Path(self.cfg.out_dir) / RECORDS_FILE, fsync=self.cfg.fsync)
        self.upstream.open()

    async def stop(self) -> None:
        # uvicorn drains in-flight requests before the lifespan ends; wait a little for relays too.
        for _ in range(50):
            if self.in_flight == 0:
                break
            await asyncio.sleep(0.1)
        await self.upstream.close()
        if self.writer is not None:
            self.writer.close()
            if self.announce:
                print(f"mosaic proxy: stopped; {self.writer.count} record(s) flushed to {self.writer.path}",
                      file=sys.stderr, flush=True)

    # -- public, for a process that embeds the proxy (a trainer) -----------------------------------
    def record(self, rec: CallRecord | RewardRecord) -> None:
        """Append a record to this proxy's records file, in line with the calls it records (thread-safe);
        raises :class:`~mosaic.capture.records.RecordError` once the proxy has stopped."""
        if self.writer is None:
            raise RecordError("the proxy has not started: no records file is open")
        self.writer.write(rec)

    def wait_quiet(self, timeout: float) -> bool:
        """Block (from another thread than the proxy's loop) until every answered call is recorded (a
        streamed call's record lands after its last byte), at most ``timeout`` seconds; whether it is."""
        t_end = time.monotonic() + timeout
        while self.in_flight > 0 and time.monotonic() < t_end:
            time.sleep(0.02)
        return self.in_flight == 0

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

    # -- the call path -------------------------------------------------------------------------
    async def handle_call(self, request, endpoint: str, rollout_id: str | None):
        t_start = time.time()
        self.check_auth(request)
        body, n_safe = safe_json(await self.read_json(request))
        validate_request(endpoint, body)
        check_max_tokens(body)
        check_sampling(body)
        check_finite(body)
        rid = rollout_id if rollout_id is not None else request.headers.get("x-mosaic-rollout", "").strip()
        rid = rid or NO_ROLLOUT_ID
        self._check_rollout(rid, "calls")
        rec = self._new_record(request, endpoint, rid, body, t_start, n_safe)
        content = self._forward_body(endpoint, body)
        headers = self._upstream_headers(request)
        path = "/chat/completions" if endpoint == "chat" else "/completions"
        deadline = asyncio.get_running_loop().time() + self.cfg.timeout_s
        self.in_flight += 1
        relaying = False
        try:
            try:
                resp = await self.upstream.send("POST", path, content, headers, stream=rec.stream, deadline=deadline)
                rec.t_first = time.time()
                data = None
                if resp.status_code >= 400 or not rec.stream:
                    data = await self._read_body(resp, rec.stream, deadline)
            except ApiError as exc:
                rec.status, rec.error = exc.status, exc.message
                rec.upstream_s = time.time() - t_start
                self._finish(rec)
                raise
            if data is not None:
                return await self._answer_full(rec, resp, data, body, headers, deadline)
            relaying = True
        finally:
            if not relaying:
                self.in_flight -= 1
        return StreamingResponse(self._relay(rec, resp, deadline), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type", "text/event-stream"))

    def _new_record(self, request, endpoint: str, rid: str, body: dict, t_start: float, n_safe: int) -> CallRecord:
        seq = next(self._seq)
        return CallRecord(
            call_id=f"{self._run}-{seq}", rollout_id=rid, seq=seq, endpoint=endpoint,
            model=str(body.get("model", "")),
            messages=body.get("messages") or [] if endpoint == "chat" else [],
            tools=body.get("tools") or [] if endpoint == "chat" else [],
            prompt=(body["prompt"][0] if isinstance(body.get("prompt"), list) else body.get("prompt"))
            if endpoint == "completions" else None,
            # as forwarded: what the upstream sampled with (a trainer's forced temperature, top-p)
            request_params={k: v for k, v in {**body, **self.force_params}.items() if k not in _FORWARD_PARAMS_SKIP},
            stream=bool(body.get("stream")), t_start=t_start,
            headers={k: v for k, v in request.headers.items() if k.startswith("x-mosaic-")},
            sanitized_text=n_safe,
        )

    def _forward_body(self, endpoint: str, body: dict) -> bytes:
        """The request as sent upstream: forced parameters, and the ids and log-probs the record needs."""
        fwd = {**body, **self.force_params}
        if self.cfg.request_token_ids:
            fwd["return_token_ids"] = True
        if endpoint == "chat":
            fwd["logprobs"] = True
        elif fwd.get("logprobs") is None:
            fwd["logprobs"] = 0
        return json.dumps(fwd).encode()

    @staticmethod
    async def _read_body(resp, stream: bool, deadline: float) -> bytes:
        """A whole answer: an error body of a streamed call is read here (within the deadline) and closed."""
        if not stream:
            return resp.content
        try:
            return await asyncio.wait_for(resp.aread(), max(0.001, deadline - asyncio.get_running_loop().time()))
        except (asyncio.TimeoutError, httpx.HTTPError) as exc:
            raise ApiError(504 if isinstance(exc, asyncio.TimeoutError) else 502,
                           f"upstream error body could not be read: {type(exc).__name__}", "upstream_error") from None
        finally:
            await resp.aclose()

    async def _answer_full(self, rec: CallRecord, resp, data: bytes, body: dict, headers: dict[str, str],
                           deadline: float) -> Response:
        """Record a whole answer (a completion, or the upstream's error) and pass it on unchanged."""
        rec.upstream_s = time.time() - rec.t_start
        rec.status = resp.status_code
        if resp.status_code >= 400:
            said = data[:2000].decode("utf-8", "replace")
            rec.error = f"upstream returned {resp.status_code}: {said[:500]}"
            if resp.status_code in (400, 413, 422) and OVERFLOW.search(said):
                await self.upstream.overflow_prompt(rec, body, headers, deadline, self.tokenizer)
        else:
            self._parse_full(rec, data)
        self._finish(rec)
        return Response(content=data, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))

    async def _relay(self, rec: CallRecord, resp, deadline: float):
        """Relay a streamed answer as it comes, folding it into the record, which is written at its end."""
        acc = StreamAccumulator(rec.endpoint)
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
                rec.upstream_s = time.time() - rec.t_start
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

    def _parse_full(self, rec: CallRecord, data: bytes) -> None:
        try:
            read_completion(rec, data)
        except Exception as exc:  # noqa: BLE001 - whatever the upstream sent, the record says so
            rec.error = f"upstream response is not a completion object: {type(exc).__name__}: {exc}"

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
        resp = await self.upstream.send("GET", path, None, self._upstream_headers(request), stream=False, deadline=deadline)
        return Response(content=resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "application/json"))


def create_proxy_app(config: ProxyConfig, *, tokenizer: Any = None,
                     accept_rollout: Callable[[str, str], bool] | None = None,
                     force_params: dict[str, Any] | None = None, upstream_app: Any = None):
    """The FastAPI app of a recording proxy (records go to ``config.out_dir/records.jsonl``).

    ``accept_rollout(rollout_id, what)``: when given, calls and rewards for a rollout id it refuses get
    404 (a trainer accepts only the ids of its step). ``force_params``: request fields set on every forwarded
    call whatever the client sent (a trainer's sampling temperature and top-p). ``upstream_app``: the upstream's
    ASGI app when it runs in this process (:class:`~mosaic.capture.upstream.UpstreamPool`)."""
    proxy = RecordingProxy(config, tokenizer=tokenizer, accept_rollout=accept_rollout, force_params=force_params,
                           upstream_app=upstream_app)

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
    @app.get("/rollouts/{rollout_id}/v1/models")
    async def models(request: Request):
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
