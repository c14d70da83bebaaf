"""An OpenAI-compatible HTTP server over a local ``transformers`` model (embedded or SmolLM2).

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` (``prompt`` as text or as a
token-id list, or a list of either, like vLLM), ``POST /v1/chat/completions``
(``messages`` rendered with the tokenizer's chat template), each streaming (SSE)
or not. Token-in, token-out extensions as in vLLM: ``return_token_ids: true`` adds
``prompt_token_ids`` and per-choice ``token_ids``; ``stop_token_ids`` adds end ids.

Concurrency: one worker thread owns the model. Requests queue up; the worker
takes everything waiting (up to ``max_batch_size`` sequences), groups it by
sampling parameters and decodes each group as one batch with
:class:`~mosaic.agent.policies.local.LocalPolicy`. So concurrent requests are
batched, and the model is never touched from two threads at once.

Batching is static: a batch decodes to its end while newer requests queue for the
next one (no continuous batching).

Log-probs are those of :class:`LocalPolicy`: the sampling log-prob of each token
under the processed (temperature / top-p) distribution; ``top_logprobs`` lists only
the sampled token (alternatives are not computed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal, Union

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.agent.policy import GenRequest

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ request schemas
class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


# ------------------------------------------------------------------ the batching worker
@dataclass
class _Job:
    reqs: list[GenRequest]
    temperature: float
    top_p: float
    stop_ids: tuple[int, ...]
    seed: int | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # ("token", choice, id, logprob) | ("done", results) | ("error", msg)
    stream: bool

    def send(self, event: tuple) -> None:
        """Hand an event to the request's event loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed (server shutting down): nobody is listening
            pass


class ModelWorker:
    """One thread that owns the model and decodes queued jobs in batches."""

    def __init__(self, policy: LocalPolicy, *, max_batch_size: int, batch_window_s: float) -> None:
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self.stats = {"batches": 0, "sequences": 0, "max_batch": 0}  # for tests and /health
        self._thread = threading.Thread(target=self._run, name="mosaic-model-worker", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        self._queue.put(job)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            n = len(job.reqs)
            deadline = time.monotonic() + self.batch_window_s
            while n < self.max_batch_size:  # gather what arrives within the window
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                jobs.append(nxt)
                n += len(nxt.reqs)
            groups: dict[tuple, list[_Job]] = {}
            for j in jobs:  # a seeded request gets its own generator, hence its own group
                key = (j.temperature, j.top_p, j.stop_ids) if j.seed is None else ("seeded", id(j))
                groups.setdefault(key, []).append(j)
            for group in groups.values():
                try:
                    self._decode(group)
                except Exception as exc:  # keep the worker alive whatever happens
                    log.exception("model worker failed")
                    for j in group:
                        j.send(("error", f"{type(exc).__name__}: {exc}"))

    def _decode(self, jobs: list[_Job]) -> None:
        flat: list[tuple[_Job, int]] = [(j, c) for j in jobs for c in range(len(j.reqs))]
        reqs = [j.reqs[c] for j, c in flat]
        first = jobs[0]
        self.stats["batches"] += 1
        self.stats["sequences"] += len(reqs)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(reqs))
        gen = None
        if first.seed is not None:
            gen = torch.Generator(device=self.policy.device).manual_seed(first.seed)

        def on_step(indices: list[int], toks: list[int], lps: list[float]) -> None:
            for i, t, lp in zip(indices, toks, lps):
                j, c = flat[i]
                if j.stream:
                    j.send(("token", c, t, lp))

        streaming = any(j.stream for j in jobs)
        results = self.policy.generate_with(  # turns batch failures into error results
            reqs, temperature=first.temperature, top_p=first.top_p,
            stop_token_ids=first.stop_ids, generator=gen,
            on_step=on_step if streaming else None)
        per_job: dict[int, list] = {}
        for (j, c), res in zip(flat, results):
            per_job.setdefault(id(j), [None] * len(j.reqs))[c] = res
        for j in jobs:
            j.send(("done", per_job[id(j)]))


# ------------------------------------------------------------------ the app
class _Server:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                 model_name: str, device: str | None, max_batch_size: int, batch_window_s: float,
                 default_max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.policy = LocalPolicy(model, tokenizer, LocalPolicyConfig(max_batch_size=max_batch_size,
                                                                      prefix_cache=False),
                                  device=device)
        self.vocab = model.get_input_embeddings().num_embeddings
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.worker = ModelWorker(self.policy, max_batch_size=max_batch_size,
                                  batch_window_s=batch_window_s)

    # ---- helpers
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           "model")

    def prompt_ids(self, prompt: Any) -> list[list[int]]:
        """Normalise a completions ``prompt`` to a list of token-id lists."""
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt:
            prompts = prompt
        else:
            raise ApiError(400, "prompt must be a non-empty string, token-id list, or list of either",
                           "prompt")
        out = []
        for p in prompts:
            ids = self.tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
            out.append(self.check_ids(ids))
        return out

    def check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ApiError(400, "prompt is empty (no tokens)", "prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise ApiError(400, f"prompt token ids out of range [0, {self.vocab}): {bad[:5]}", "prompt")
        if self.max_positions is not None and len(ids) >= self.max_positions:
            raise ApiError(400, f"prompt has {len(ids)} tokens; the model's context is "
                                f"{self.max_positions}", "prompt")
        return ids

    def stop_ids(self, body: _Common) -> tuple[int, ...]:
        if body.stop:
            raise ApiError(400, "stop strings are not supported; use stop_token_ids", "stop")
        extra = tuple(body.stop_token_ids or ())
        bad = [t for t in extra if not 0 <= t < self.vocab]
        if bad:
            raise ApiError(400, f"stop_token_ids out of range: {bad[:5]}", "stop_token_ids")
        return tuple(sorted(set(self.policy.stop_ids) | set(extra)))

    def max_new(self, value: int | None, prompt_len: int) -> int:
        n = self.default_max_tokens if value is None else value
        if self.max_positions is not None:
            n = min(n, self.max_positions - prompt_len)
        return n

    def submit(self, prompts: list[list[int]], body: _Common, max_tokens: int | None) -> _Job:
        reqs = [GenRequest(f"http-{uuid.uuid4().hex[:8]}", p, self.max_new(max_tokens, len(p)))
                for p in prompts for _ in range(body.n)]
        job = _Job(reqs, body.temperature, body.top_p, self.stop_ids(body), body.seed,
                   asyncio.get_running_loop(), asyncio.Queue(), body.stream)
        self.worker.submit(job)
        return job

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def token_str(self, t: int) -> str:
        return self.tokenizer.decode([t])


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": kind, "param": param, "code": status}})


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(prompt_lens: list[int], results: list) -> dict[str, int]:
    p, c = sum(prompt_lens), sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _wait_done(job: _Job) -> list:
    while True:
        ev = await job.events.get()
        if ev[0] == "done":
            return ev[1]
        if ev[0] == "error":
            raise ApiError(500, f"generation failed: {ev[1]}")


def _raise_result_errors(results: list) -> None:
    errs = [r.error for r in results if r.finish_reason == "error"]
    if errs:
        raise ApiError(500, f"generation failed: {errs[0]}")


def create_app(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
               model_name: str = "mosaic-local", device: str | None = None, max_batch_size: int = 64,
               batch_window_s: float = 0.002, default_max_tokens: int = 16) -> FastAPI:
    """The FastAPI app serving ``model``; start it with ``uvicorn.run(app, ...)`` or in-process.

    ``batch_window_s``: how long the worker waits for more requests to join a batch.
    ``default_max_tokens``: used when a request gives no ``max_tokens`` (OpenAI's default is 16).
    """
    srv = _Server(model, tokenizer, model_name=model_name, device=device,
                  max_batch_size=max_batch_size, batch_window_s=batch_window_s,
                  default_max_tokens=default_max_tokens)
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        srv.worker.close()

    app = FastAPI(title="mosaic serve", version="0.1", lifespan=lifespan)
    app.state.server = srv

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return _error(400, "; ".join(parts) or "invalid request")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "worker": dict(srv.worker.stats)}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "mosaic"}]}

    # ---------------------------------------------------------- /v1/completions
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        srv.check_model(body.model)
        if body.echo:
            raise ApiError(400, "echo is not supported", "echo")
        prompts = srv.prompt_ids(body.prompt)
        job = srv.submit(prompts, body, body.max_tokens)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_of = [p for p in prompts for _ in range(body.n)]
        if body.stream:
            return StreamingResponse(_stream_completion(srv, job, body, cid, created, prompt_of),
                                     media_type="text/event-stream")
        results = await _wait_done(job)
        _raise_result_errors(results)
        choices = []
        for c, res in enumerate(results):
            choice: dict[str, Any] = {"index": c, "text": srv.decode(res.token_ids, body.skip_special_tokens),
                                      "logprobs": None, "finish_reason": res.finish_reason}
            if body.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(srv, res.token_ids, res.logprobs, body.logprobs)
            if body.return_token_ids:
                choice["prompt_token_ids"] = prompt_of[c]
                choice["token_ids"] = res.token_ids
            choices.append(choice)
        return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": _usage([len(p) for p in prompt_of], results)}

    # ---------------------------------------------------------- /v1/chat/completions
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        srv.check_model(body.model)
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions")
        messages = [m.model_dump() for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                 tokenize=False)
        except Exception as exc:
            raise ApiError(400, f"chat template failed: {exc}", "messages") from exc
        ids = srv.check_ids(tokenizer(text, add_special_tokens=False)["input_ids"])
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        job = srv.submit([ids], body, max_tokens)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return StreamingResponse(_stream_chat(srv, job, body, cid, created, ids),
                                     media_type="text/event-stream")
        results = await _wait_done(job)
        _raise_result_errors(results)
        choices = []
        for c, res in enumerate(results):
            choice: dict[str, Any] = {
                "index": c, "finish_reason": res.finish_reason, "logprobs": None,
                "message": {"role": "assistant",
                            "content": srv.decode(res.token_ids, body.skip_special_tokens)}}
            if body.logprobs:
                choice["logprobs"] = {"content": [_chat_lp(srv, t, lp) for t, lp in
                                                  zip(res.token_ids, res.logprobs)]}
            if body.return_token_ids:
                choice["token_ids"] = res.token_ids
            choices.append(choice)
        out = {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
               "choices": choices, "usage": _usage([len(ids)] * len(results), results)}
        if body.return_token_ids:
            out["prompt_token_ids"] = ids
        return out

    return app


def _completion_logprobs(srv: _Server, ids: list[int], lps: list[float], top: int) -> dict:
    tokens = [srv.token_str(t) for t in ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets,
            "top_logprobs": [{s: lp} for s, lp in zip(tokens, lps)] if top > 0 else None}


def _chat_lp(srv: _Server, t: int, lp: float) -> dict:
    s = srv.token_str(t)
    return {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}


class _Detok:
    """Incremental detokenisation per choice: a delta is held back while it ends in an
    incomplete UTF-8 sequence, so multi-byte characters split over tokens stream whole."""

    def __init__(self, srv: _Server, skip_special: bool) -> None:
        self.srv, self.skip = srv, skip_special
        self.ids: dict[int, list[int]] = {}
        self.sent: dict[int, str] = {}

    def push(self, c: int, t: int) -> str:
        ids = self.ids.setdefault(c, [])
        ids.append(t)
        text = self.srv.decode(ids, self.skip)
        if text.endswith("\ufffd"):
            return ""
        return self._delta(c, text)

    def flush(self, c: int) -> str:
        return self._delta(c, self.srv.decode(self.ids.get(c, []), self.skip))

    def _delta(self, c: int, text: str) -> str:
        prev = self.sent.get(c, "")
        self.sent[c] = text
        return text[len(prev):] if text.startswith(prev) else text


async def _stream_events(srv: _Server, job: _Job) -> AsyncIterator[tuple]:
    """Yields ("token", choice, id, lp) and finally ("done", results)."""
    while True:
        ev = await job.events.get()
        if ev[0] == "error":
            yield ("error", ev[1])
            return
        yield ev
        if ev[0] == "done":
            return


async def _stream_completion(srv: _Server, job: _Job, body: CompletionRequest, cid: str, created: int,
                             prompt_of: list[list[int]]) -> AsyncIterator[str]:
    head = {"id": cid, "object": "text_completion", "created": created, "model": srv.model_name}
    sent_prompt = set()
    detok = _Detok(srv, body.skip_special_tokens)
    async for ev in _stream_events(srv, job):
        if ev[0] == "token":
            _, c, t, lp = ev
            choice: dict[str, Any] = {"index": c, "text": detok.push(c, t),
                                      "logprobs": None, "finish_reason": None}
            if body.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(srv, [t], [lp], body.logprobs)
            if body.return_token_ids:
                choice["token_ids"] = [t]
                if c not in sent_prompt:
                    choice["prompt_token_ids"] = prompt_of[c]
                    sent_prompt.add(c)
            yield _sse({**head, "choices": [choice]})
        elif ev[0] == "done":
            results = ev[1]
            for c, res in enumerate(results):
                choice = {"index": c, "text": detok.flush(c), "logprobs": None,
                          "finish_reason": res.finish_reason}
                if body.return_token_ids:
                    choice["token_ids"] = []
                    if c not in sent_prompt:
                        choice["prompt_token_ids"] = prompt_of[c]
                if res.finish_reason == "error":
                    choice["error"] = res.error
                yield _sse({**head, "choices": [choice]})
            yield _sse({**head, "choices": [], "usage": _usage([len(p) for p in prompt_of], results)})
        else:
            yield _sse({"error": {"message": f"generation failed: {ev[1]}", "type": "server_error",
                                  "code": 500}})
    yield "data: [DONE]\n\n"


async def _stream_chat(srv: _Server, job: _Job, body: ChatCompletionRequest, cid: str, created: int,
                       prompt_ids: list[int]) -> AsyncIterator[str]:
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": srv.model_name}
    first = {"role": "assistant", "content": ""}
    roles = [{**head, "choices": [{"index": c, "delta": first, "logprobs": None, "finish_reason": None}]}
             for c in range(body.n)]
    if body.return_token_ids:
        roles[0]["prompt_token_ids"] = prompt_ids
    for r in roles:
        yield _sse(r)
    detok = _Detok(srv, body.skip_special_tokens)
    async for ev in _stream_events(srv, job):
        if ev[0] == "token":
            _, c, t, lp = ev
            choice: dict[str, Any] = {"index": c, "delta": {"content": detok.push(c, t)},
                                      "logprobs": None, "finish_reason": None}
            if body.logprobs:
                choice["logprobs"] = {"content": [_chat_lp(srv, t, lp)]}
            if body.return_token_ids:
                choice["token_ids"] = [t]
            yield _sse({**head, "choices": [choice]})
        elif ev[0] == "done":
            results = ev[1]
            for c, res in enumerate(results):
                rest = detok.flush(c)
                yield _sse({**head, "choices": [{"index": c, "delta": {"content": rest} if rest else {},
                                                 "logprobs": None, "finish_reason": res.finish_reason}]})
            yield _sse({**head, "choices": [], "usage": _usage([len(prompt_ids)] * len(results), results)})
        else:
            yield _sse({"error": {"message": f"generation failed: {ev[1]}", "type": "server_error",
                                  "code": 500}})
    yield "data: [DONE]\n\n"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, *, host: str = "127.0.0.1", port: int | None = None,
                    startup_timeout_s: float = 30.0):
    """Run ``app`` with uvicorn in a background thread; yields its base URL (``http://host:port``).

    For tests and in-process use: the server stops (and the model worker with it) on exit.
    """
    import uvicorn

    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name="mosaic-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"server on {host}:{port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
