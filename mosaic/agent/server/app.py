"""The FastAPI app of ``mosaic serve``: request checks, the two completion endpoints, routing."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.agent.policy import GenRequest
from mosaic.agent.server.schema import (
    ApiError, BaseCompletionRequest, ChatCompletionRequest, CompletionRequest, chat_logprob, completion_logprobs,
    error_response, usage,
)
from mosaic.agent.server.stream import stream_chat, stream_completion
from mosaic.agent.server.worker import Job, ModelWorker


class ModelServer:
    """The state behind the app: tokenizer, policy and worker; request checks and the handlers."""

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

    # ---- request checks
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

    def stop_ids(self, body: BaseCompletionRequest) -> tuple[int, ...]:
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

    # ---- generation
    def submit(self, prompts: list[list[int]], body: BaseCompletionRequest, max_tokens: int | None) -> Job:
        reqs = [GenRequest(f"http-{uuid.uuid4().hex[:8]}", p, self.max_new(max_tokens, len(p)))
                for p in prompts for _ in range(body.n)]
        job = Job(reqs, body.temperature, body.top_p, self.stop_ids(body), body.seed,
                  asyncio.get_running_loop(), asyncio.Queue(), body.stream)
        self.worker.submit(job)
        return job

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def token_str(self, t: int) -> str:
        return self.tokenizer.decode([t])

    # ---- the endpoints
    async def completions(self, body: CompletionRequest):
        self.check_model(body.model)
        if body.echo:
            raise ApiError(400, "echo is not supported", "echo")
        prompts = self.prompt_ids(body.prompt)
        job = self.submit(prompts, body, body.max_tokens)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_of = [p for p in prompts for _ in range(body.n)]
        if body.stream:
            return StreamingResponse(stream_completion(self, job, body, cid, created, prompt_of),
                                     media_type="text/event-stream")
        results = await _results(job)
        choices = []
        for c, res in enumerate(results):
            choice: dict[str, Any] = {"index": c, "text": self.decode(res.token_ids, body.skip_special_tokens),
                                      "logprobs": None, "finish_reason": res.finish_reason}
            if body.logprobs is not None:
                choice["logprobs"] = completion_logprobs(self.token_str, res.token_ids, res.logprobs,
                                                         body.logprobs)
            if body.return_token_ids:
                choice["prompt_token_ids"] = prompt_of[c]
                choice["token_ids"] = res.token_ids
            choices.append(choice)
        return {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": usage([len(p) for p in prompt_of], results)}

    async def chat(self, body: ChatCompletionRequest):
        self.check_model(body.model)
        ids = self.check_ids(self.tokenizer(self._render_chat(body), add_special_tokens=False)["input_ids"])
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        job = self.submit([ids], body, max_tokens)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return StreamingResponse(stream_chat(self, job, body, cid, created, ids),
                                     media_type="text/event-stream")
        results = await _results(job)
        choices = []
        for c, res in enumerate(results):
            choice: dict[str, Any] = {
                "index": c, "finish_reason": res.finish_reason, "logprobs": None,
                "message": {"role": "assistant",
                            "content": self.decode(res.token_ids, body.skip_special_tokens)}}
            if body.logprobs:
                choice["logprobs"] = {"content": [chat_logprob(self.token_str, t, lp) for t, lp in
                                                  zip(res.token_ids, res.logprobs)]}
            if body.return_token_ids:
                choice["token_ids"] = res.token_ids
            choices.append(choice)
        out = {"id": cid, "object": "chat.completion", "created": created, "model": self.model_name,
               "choices": choices, "usage": usage([len(ids)] * len(results), results)}
        if body.return_token_ids:
            out["prompt_token_ids"] = ids
        return out

    def _render_chat(self, body: ChatCompletionRequest) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions")
        messages = [m.model_dump() for m in body.messages]
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                      tokenize=False)
        except Exception as exc:
            raise ApiError(400, f"chat template failed: {exc}", "messages") from exc


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


def create_app(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
               model_name: str = "mosaic-local", device: str | None = None, max_batch_size: int = 64,
               batch_window_s: float = 0.002, default_max_tokens: int = 16) -> FastAPI:
    """The FastAPI app serving ``model``; run it with :func:`mosaic.serving.run_server` (foreground) or
    :class:`mosaic.serving.ServerThread` (in-process).

    ``batch_window_s``: how long the worker waits for more requests to join a batch.
    ``default_max_tokens``: used when a request gives no ``max_tokens`` (OpenAI's default is 16).
    """
    srv = ModelServer(model, tokenizer, model_name=model_name, device=device,
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
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return error_response(400, "; ".join(parts) or "invalid request")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "worker": dict(srv.worker.stats)}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "mosaic"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await srv.completions(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await srv.chat(body)

    return app
