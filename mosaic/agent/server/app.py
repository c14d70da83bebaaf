"""The FastAPI app of ``mosaic serve``: request checks, the two completion endpoints, routing.

Guards: a body over ``max_body_bytes`` is refused with 413 before it is read whole; with ``api_key`` every route but
``/health`` needs ``Authorization: Bearer <key>`` (401). Parsing a body of ``inline_body_bytes`` or more, rendering
its chat template and tokenising run in worker threads, so a large request never stalls the event loop; a smaller
one is handled on the loop (well under a millisecond of work, where a thread's round trip cost 1-2 ms on a busy
2-core machine); answers go out as plain JSON.

Work per request is bounded by the model's context, not by the body limit: a prompt text (a completions string, a
rendered chat) longer than ``(context - 1) * L`` characters is refused with 400 before it is tokenised, where ``L``,
the longest token string in the vocabulary, bounds the characters one token covers (byte-level BPE writes each byte
of the text as one character of a token string; SentencePiece one character as one), so such a text could never fit.
At most ``max_heavy_requests`` bodies of ``heavy_body_bytes`` or more are parsed and tokenised at once; one more
gets 503 (``Retry-After: 1``) at once, without being parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.agent.policy import GenRequest
from mosaic.agent.server.schema import (
    ApiError, BaseCompletionRequest, ChatCompletionRequest, CompletionRequest, chat_logprob, completion_logprobs,
    error_response, json_response, usage,
)
from mosaic.agent.server.stream import ChoiceText, stream_chat, stream_completion
from mosaic.agent.server.textops import render_chat
from mosaic.agent.server.procworker import ProcessWorker, start_worker
from mosaic.agent.server.worker import Job

INLINE_RESULT_TOKENS = 4096  # an answer of at most this many sampled tokens is written out on the event loop


class ModelServer:
    """The state behind the app: tokenizer, policy and worker; request checks and the handlers."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                 model_name: str, device: str | None, max_batch_size: int, batch_window_s: float,
                 default_max_tokens: int, prefix_cache_tokens: int = 65536, continuous_batching: bool = True,
                 heavy_body_bytes: int = 1 << 20, max_heavy_requests: int = 4,
                 inline_body_bytes: int = 32 * 1024, worker_process: bool = False) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        # Requests carry no session: the KV cache is looked up by content (the longest cached prefix of the
        # prompt: a harness re-sends each turn's whole context), dropped whenever the weights change.
        pc = LocalPolicyConfig(max_batch_size=max_batch_size, prefix_cache=prefix_cache_tokens > 0,
                               prefix_cache_tokens=max(prefix_cache_tokens, 0), shared_prefix=True,
                               continuous_batching=continuous_batching)
        self.policy = LocalPolicy(model, tokenizer, pc, device=device)
        self.vocab = model.get_input_embeddings().num_embeddings
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.token_chars = chars_per_token(tokenizer)
        self.max_chars = (self.max_positions - 1) * self.token_chars if self.max_positions else None
        self.heavy_body_bytes, self.max_heavy, self.heavy_now = heavy_body_bytes, max_heavy_requests, 0
        self.inline_body_bytes = inline_body_bytes
        self.worker_args = dict(process=worker_process, max_batch_size=max_batch_size, batch_window_s=batch_window_s)
        # worker_fallback: why a worker process asked for did not start (the model then decodes in a thread)
        self.worker, self.worker_fallback = start_worker(self.policy, tokenizer, **self.worker_args)

    @contextlib.contextmanager
    def weights_update(self):
        """A context manager held while the caller changes the weights in place (a trainer's update): no request
        decodes meanwhile (those that arrive wait); the ``policy_version`` responses carry goes up by one on exit.
        A worker process the update left reading replaced tensors is replaced at once, over the new ones."""
        with self.worker.weights_update():
            yield
        if isinstance(self.worker, ProcessWorker) and self.worker.replaced:
            self.revive_worker()  # (the old one said why it stopped)

    def revive_worker(self) -> bool:
        """Replace a worker process that died by a new one at the same policy version (True); else False."""
        old = self.worker
        if not isinstance(old, ProcessWorker) or not old.gone:
            return False
        old.close()
        self.worker, self.worker_fallback = start_worker(self.policy, self.tokenizer, version=old.version,
                                                         **self.worker_args)
        return True

    @property
    def policy_version(self) -> int:
        return self.worker.version

    # ---- request checks
    @contextlib.asynccontextmanager
    async def heavy_slot(self, nbytes: int):
        """Held while a body of ``heavy_body_bytes`` or more is parsed and tokenised; 503 when
        ``max_heavy_requests`` are already (smaller bodies pass freely)."""
        if nbytes < self.heavy_body_bytes:
            yield
            return
        if self.heavy_now >= self.max_heavy:
            raise ApiError(503, f"server busy: {self.heavy_now} large requests (>= {self.heavy_body_bytes} "
                                f"bytes) are being prepared, the most allowed (max_heavy_requests); retry later")
        self.heavy_now += 1
        try:
            yield
        finally:
            self.heavy_now -= 1

    def check_chars(self, text: str, param: str) -> str:
        """``text`` unless it is too long to fit the context whatever its tokens (400, before tokenising)."""
        if self.max_chars is not None and len(text) > self.max_chars:
            raise ApiError(400, f"prompt has {len(text)} characters; the model's context is {self.max_positions} "
                                f"tokens of at most {self.token_chars} characters each, so at most "
                                f"{self.max_chars} characters can fit", param)
        return text

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}", "model")

    def prompt_ids(self, prompt: Any) -> list[list[int]]:
        """Normalise a completions ``prompt`` to a list of token-id lists."""
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt:
            prompts = prompt
        else:
            raise ApiError(400, "prompt must be a non-empty string, token-id list, or list of either", "prompt")
        return [self.check_ids(self.tokenizer(self.check_chars(p, "prompt"), add_special_tokens=False)["input_ids"]
                               if isinstance(p, str) else list(p)) for p in prompts]

    def check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ApiError(400, "prompt is empty (no tokens)", "prompt")
        if self.max_positions is not None and len(ids) >= self.max_positions:
            raise ApiError(400, f"prompt has {len(ids)} tokens; the model's context is {self.max_positions}", "prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise ApiError(400, f"prompt token ids out of range [0, {self.vocab}): {bad[:5]}", "prompt")
        return ids

    def stop_ids(self, body: BaseCompletionRequest) -> tuple[int, ...]:
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

    # ---- generation
    def submit(self, prompts: list[list[int]], body: BaseCompletionRequest, max_tokens: int | None) -> Job:
        reqs = [GenRequest(f"http-{uuid.uuid4().hex[:8]}", p, self.max_new(max_tokens, len(p)))
                for p in prompts for _ in range(body.n)]
        job = Job(reqs, body.temperature, body.top_p, self.stop_ids(body), body.seed,
                  asyncio.get_running_loop(), asyncio.Queue(), body.stream,
                  tuple(body.stop or ()), body.skip_special_tokens)
        self.worker.submit(job)
        return job

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def token_str(self, t: int) -> str:
        return self.tokenizer.decode([t])

    # ---- the endpoints
    async def off_loop(self, inline: bool, fn, *args):
        """``fn(*args)`` on the event loop when ``inline`` (small: cheaper than a thread's round trip), else in a
        thread."""
        return fn(*args) if inline else await asyncio.to_thread(fn, *args)

    async def completion_prompts(self, body: CompletionRequest, inline: bool = False) -> list[list[int]]:
        self.check_model(body.model)
        if body.echo:
            raise ApiError(400, "echo is not supported", "echo")
        return await self.off_loop(inline, self.prompt_ids, body.prompt)

    async def _answer(self, body: BaseCompletionRequest, prompts: list[list[int]], max_tokens: int | None, *,
                      prefix: str, stream, to_json, prompt_of):
        """The one generation path of both endpoints: submit, then stream (``stream``) or answer whole
        (``to_json``); ``prompt_of``: what the endpoint's response reports as each choice's prompt."""
        job = self.submit(prompts, body, max_tokens)
        cid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return StreamingResponse(stream(self, job, body, cid, created, prompt_of), media_type="text/event-stream")
        results = await _results(job)
        small = sum(len(r.token_ids) for r in results) <= INLINE_RESULT_TOKENS
        return json_response(await self.off_loop(small, to_json, body, results, cid, created, prompt_of, job.version))

    async def completions(self, body: CompletionRequest, prompts: list[list[int]]):
        return await self._answer(body, prompts, body.max_tokens, prefix="cmpl", stream=stream_completion,
                                  to_json=self._completion_json, prompt_of=[p for p in prompts for _ in range(body.n)])

    def _completion_json(self, body: CompletionRequest, results: list, cid: str, created: int,
                         prompt_of: list[list[int]], job_version: int | None = None) -> dict:
        text = ChoiceText(self, body.skip_special_tokens, body.stop)
        choices, counts = [], []
        for c, res in enumerate(results):
            rest, _, finish, n = text.finish(c, res)
            ids, lps = res.token_ids[:n], res.logprobs[:n]
            counts.append(n)
            choice: dict[str, Any] = {"index": c, "text": rest, "logprobs": None, "finish_reason": finish}
            if body.logprobs is not None:
                choice["logprobs"] = completion_logprobs(self.token_str, ids, lps, body.logprobs)
            if body.return_token_ids:
                choice["prompt_token_ids"] = prompt_of[c]
                choice["token_ids"] = ids
            choices.append(choice)
        return {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage([len(p) for p in prompt_of], counts),
                "policy_version": job_version}

    async def chat_prompt(self, body: ChatCompletionRequest, inline: bool = False) -> list[int]:
        self.check_model(body.model)
        return await self.off_loop(inline, self._chat_ids, body)

    async def chat(self, body: ChatCompletionRequest, ids: list[int]):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await self._answer(body, [ids], max_tokens, prefix="chatcmpl", stream=stream_chat,
                                  to_json=self._chat_json, prompt_of=ids)

    def _chat_json(self, body: ChatCompletionRequest, results: list, cid: str, created: int,
                   ids: list[int], job_version: int | None = None) -> dict:
        text = ChoiceText(self, body.skip_special_tokens, body.stop, body.uses_tools)
        choices, counts = [], []
        for c, res in enumerate(results):
            content, calls, finish, n = text.finish(c, res)
            toks, lps = res.token_ids[:n], res.logprobs[:n]
            counts.append(n)
            message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
            if calls:
                message["tool_calls"] = calls
            choice: dict[str, Any] = {"index": c, "finish_reason": finish, "logprobs": None, "message": message}
            if body.logprobs:
                choice["logprobs"] = {"content": [chat_logprob(self.token_str, t, lp) for t, lp in zip(toks, lps)]}
            if body.return_token_ids:
                choice["token_ids"] = toks
            choices.append(choice)
        out = {"id": cid, "object": "chat.completion", "created": created, "model": self.model_name,
               "choices": choices, "usage": usage([len(ids)] * len(results), counts),
               "policy_version": job_version}
        if body.return_token_ids:
            out["prompt_token_ids"] = ids
        return out

    def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        """The prompt's ids (runs in a worker thread: the template and the tokenizer)."""
        text = self.check_chars(self._render_chat(body), "messages")
        return self.check_ids(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _render_chat(self, body: ChatCompletionRequest) -> str:
        return render_chat(self.tokenizer, body)


def chars_per_token(tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound on the characters of text one token stands for: the longest token string in the
    vocabulary (added tokens included)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def _lone_surrogate(obj: Any) -> bool:
    """Whether any string (key or value) in a parsed JSON body cannot be encoded as UTF-8."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    """A request body → its model (runs in a worker thread); 400 naming the fields otherwise."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {str(exc)[:200]}") from None
    if _lone_surrogate(obj):
        raise ApiError(400, "request body holds a lone surrogate escape (e.g. \\udfff): not valid Unicode text")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()))
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        raise ApiError(400, "; ".join(parts[:8]) or "invalid request") from None


class Guard:
    """ASGI middleware: the body limit (413, counted as it arrives) and the bearer token (401)."""

    def __init__(self, app, *, max_body_bytes: int, api_key: str | None) -> None:
        self.app, self.limit, self.key = app, max_body_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.key is not None and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, b"Bearer " + self.key.encode()):
                return await error_response(401, "missing or wrong bearer token")(scope, receive, send)
        headers = dict(scope["headers"])
        cl = headers.get(b"content-length", b"")
        if cl.isdigit() and int(cl) > self.limit:
            return await error_response(413, f"request body of {int(cl)} bytes exceeds the limit of "
                                             f"{self.limit}")(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, n = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            n += len(chunk)
            if n > self.limit:
                return await error_response(413, f"request body exceeds the limit of {self.limit} bytes")(
                    scope, receive, send)
            chunks.append(chunk)
            if not msg.get("more_body"):
                break
        body, done = b"".join(chunks), False

        async def replay():
            nonlocal done
            if not done:
                done = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def _results(job: Job) -> list:
    """The job's results once done; ApiError 500 if the worker or any sequence failed."""
    while True:
        ev = await job.events.get()
        if ev[0] == "error":
            raise ApiError(500, f"generation failed: {ev[1]}")
        if ev[0] == "done":
            break
    errs = [r.error for r in ev[1] if r.finish_reason == "error"]
    if errs:
        raise ApiError(500, f"generation failed: {errs[0]}")
    return ev[1]


def _add_routes(app: FastAPI, srv: ModelServer, model_name: str) -> None:
    """The error handler and the routes: ``/health``, ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``
    (a large body is parsed and tokenised only in one of the server's heavy-request slots)."""
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        resp = error_response(exc.status, exc.message, exc.param)
        if exc.status == 503:
            resp.headers["Retry-After"] = "1"
        return resp

    @app.get("/health")
    async def health() -> JSONResponse:  # 503 once a worker process has died: nothing is served until a restart
        w, dead = srv.worker, getattr(srv.worker, "dead", None)
        return JSONResponse({"status": "worker_dead" if dead else "ok", "worker": dict(w.stats), "worker_dead": dead,
                             "worker_process": isinstance(w, ProcessWorker), "worker_fallback": srv.worker_fallback},
                            status_code=503 if dead else 200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "mosaic"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = await request.body()
        async with srv.heavy_slot(len(raw)):
            inline = len(raw) < srv.inline_body_bytes
            body = await srv.off_loop(inline, _parse, CompletionRequest, raw)
            prompts = await srv.completion_prompts(body, inline)
        return await srv.completions(body, prompts)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        raw = await request.body()
        async with srv.heavy_slot(len(raw)):
            inline = len(raw) < srv.inline_body_bytes
            body = await srv.off_loop(inline, _parse, ChatCompletionRequest, raw)
            ids = await srv.chat_prompt(body, inline)
        return await srv.chat(body, ids)


def create_app(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
               model_name: str = "mosaic-local", device: str | None = None, max_batch_size: int = 64,
               batch_window_s: float = 0.002, default_max_tokens: int = 16, api_key: str | None = None,
               max_body_bytes: int = 32 * 1024 * 1024, prefix_cache_tokens: int = 65536,
               heavy_body_bytes: int = 1 << 20, max_heavy_requests: int = 4,
               continuous_batching: bool = True, inline_body_bytes: int = 32 * 1024,
               worker_process: bool = False) -> FastAPI:
    """The FastAPI app serving ``model``; run it with :func:`mosaic.serving.run_server` (foreground) or
    :class:`mosaic.serving.ServerThread` (in-process).

    ``batch_window_s``: how long the worker waits for more requests to join a batch.
    ``default_max_tokens``: used when a request gives no ``max_tokens`` (OpenAI's default is 16).
    ``api_key``: bearer token every route but ``/health`` requires (None: open).
    ``max_body_bytes``: largest request body accepted (413 above).
    ``prefix_cache_tokens``: tokens of KV cache kept across requests, found by the longest common prefix with a
    new prompt (0: none); dropped whenever the weights change. ``heavy_body_bytes``, ``max_heavy_requests``: at
    most this many bodies of that size or more are parsed and tokenised at once (503 beyond).
    ``continuous_batching``: requests that arrive while a batch decodes join it (same sampling parameters,
    unseeded) instead of waiting for it to end; results are sent as each request finishes.
    ``inline_body_bytes``: smaller bodies are parsed and tokenised on the event loop (0: all in threads).
    ``worker_process``: the model decodes in a worker process over shared weights (``ProcessWorker``); if it
    cannot start, in a thread, with a warning.
    """
    if max_body_bytes < 1 or max_heavy_requests < 1:
        raise ValueError(f"max_body_bytes {max_body_bytes}, max_heavy_requests {max_heavy_requests}: must be > 0")
    srv = ModelServer(model, tokenizer, model_name=model_name, device=device, max_batch_size=max_batch_size,
                      batch_window_s=batch_window_s, default_max_tokens=default_max_tokens,
                      prefix_cache_tokens=prefix_cache_tokens, heavy_body_bytes=heavy_body_bytes,
                      max_heavy_requests=max_heavy_requests, continuous_batching=continuous_batching,
                      inline_body_bytes=inline_body_bytes, worker_process=worker_process)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        srv.worker.close()

    app = FastAPI(title="mosaic serve", version="0.1", lifespan=lifespan)
    app.state.server = srv
    app.add_middleware(Guard, max_body_bytes=max_body_bytes, api_key=api_key)
    _add_routes(app, srv, model_name)
    return app
