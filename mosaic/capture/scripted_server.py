"""The scripted upstream's server: an OpenAI-compatible FastAPI app (chat and completions,
streamed or not, ``POST /tokenize``) whose replies come from :func:`mosaic.capture.scripted.decide`.

It records every request body (``calls``) and every generation (``log``), returns token ids and
sampling log-probs when asked, and imitates a real server's limits (slots, context length,
``fail-NNN`` models for fault tests). See :mod:`mosaic.capture.scripted` for the behaviour.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request  # module level: FastAPI resolves route annotations by name
from fastapi.responses import JSONResponse, StreamingResponse

from mosaic.capture.scripted import Renderer, decide, render_tool_calls

@dataclass
class ScriptedConfig:
    """Settings of the scripted upstream.

    Attributes:
        token_ids: return ``prompt_token_ids`` / ``token_ids`` when the request asks
            (``return_token_ids``); False imitates a server that cannot.
        logprobs: return sampling log-probs when the request asks.
        delay_s: simulated generation time per request (``X-Scripted-Delay`` overrides it).
        slots: requests generated at once (like vLLM's ``max_num_seqs``); others queue.
            0 = unlimited. With slots the server has a fixed capacity, ``slots / delay_s`` req/s.
        chunk_delay_s: pause between streamed chunks (to test clients that leave mid-stream).
        model: the model name it reports.
        max_context: refuse a chat request whose prompt + ``max_tokens`` exceed it with vLLM's 400
            ("maximum context length"); 0 = no limit. ``POST /tokenize`` gives a prompt's ids, as vLLM's does.
        sse_newline: the line ending of streamed events (``"\\r\\n"``: CRLF framing, valid SSE).
    """

    token_ids: bool = True
    logprobs: bool = True
    delay_s: float = 0.0
    slots: int = 0
    chunk_delay_s: float = 0.0
    model: str = "scripted"
    max_context: int = 0
    sse_newline: str = "\n"


def _clean(obj: Any) -> Any:
    """Lone surrogates (JSON lets a client send ``"\\udfff"``) become U+FFFD, as a server that
    decodes text leniently would see them."""
    if isinstance(obj, str):
        return obj.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    if isinstance(obj, list):
        return [_clean(x) for x in obj]
    if isinstance(obj, dict):
        return {_clean(k): _clean(v) for k, v in obj.items()}
    return obj


def _refused(exc: Exception) -> JSONResponse:
    """A request the script cannot read (a wrong schema): 400, as a real server answers it."""
    return JSONResponse({"object": "error", "type": "BadRequestError", "code": 400,
                         "message": f"scripted upstream cannot read this request: {type(exc).__name__}: {exc}"},
                        status_code=400)


def fake_logprob(i: int, tok: int) -> float:
    return -0.05 - 0.01 * ((tok + i) % 7)


def _usage(prompt_ids: list[int], comp: list[int]) -> dict[str, int]:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(comp),
            "total_tokens": len(prompt_ids) + len(comp)}


@dataclass
class _ChatTurn:
    """One scripted chat reply, with what the request asked to get back."""

    prompt_ids: list[int]
    comp: list[int]
    text: str
    tool_calls: list[dict[str, Any]]
    finish: str
    want_ids: bool
    want_lp: bool
    lps: list[float] = field(default_factory=list)
    rid: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex[:16])
    created: int = field(default_factory=lambda: int(time.time()))


class ScriptedUpstream:
    """The state behind the scripted app: its renderer, every request body (``calls``) and every
    generation (``log``: prompt ids, completion ids — what the "model" saw and produced)."""

    def __init__(self, tokenizer, config: ScriptedConfig | None = None):
        self.cfg = config or ScriptedConfig()
        self.rnd = Renderer(tokenizer)
        self.calls: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # each generation request's headers
        self.log: list[tuple[list[int], list[int]]] = []
        self.sem = asyncio.Semaphore(self.cfg.slots) if self.cfg.slots > 0 else None

    async def _delay(self, request: Request) -> None:
        d = float(request.headers.get("x-scripted-delay", self.cfg.delay_s))
        if self.sem is not None:
            async with self.sem:
                await asyncio.sleep(d)
        elif d > 0:
            await asyncio.sleep(d)

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, request: Request):
        body = _clean(await request.json())
        self.calls.append(body)
        m = re.fullmatch(r"fail-(\d{3})", str(body.get("model", "")))
        if m:  # an upstream error on request, for fault tests
            code = int(m.group(1))
            return JSONResponse({"error": {"message": f"scripted failure {code}", "type": "scripted"}},
                                status_code=code)
        self.headers.append(dict(request.headers))
        if self.cfg.max_context:
            try:
                n = len(self.rnd.chat_prompt(body.get("messages") or [], body.get("tools") or None))
                want = n + int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            except Exception as exc:  # noqa: BLE001 - any unreadable request is the client's fault
                return _refused(exc)
            if want > self.cfg.max_context:
                return JSONResponse({"object": "error", "type": "BadRequestError", "code": 400, "message": (
                    f"This model's maximum context length is {self.cfg.max_context} tokens. However, you "
                    f"requested {want} tokens ({n} in the messages). Please reduce the length of the messages.")},
                    status_code=400)
        await self._delay(request)
        try:
            turn = self._chat_turn(body)
        except Exception as exc:  # noqa: BLE001 - any unreadable request is the client's fault
            return _refused(exc)
        if not body.get("stream"):
            return JSONResponse(self._chat_json(turn))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(self._chat_stream(turn, include_usage), media_type="text/event-stream")

    def _chat_turn(self, body: dict[str, Any]) -> _ChatTurn:
        rnd = self.rnd
        messages, tools = body.get("messages") or [], body.get("tools") or None
        text, tool_calls = decide(messages, tools)
        prompt_ids = rnd.chat_prompt(messages, tools)
        comp = rnd.completion(text + render_tool_calls(tool_calls))
        finish = "tool_calls" if tool_calls else "stop"
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and len(comp) > int(max_tokens):
            comp, finish, tool_calls = comp[: int(max_tokens)], "length", []
            text = rnd.decode([t for t in comp if t != rnd.im_end])
        self.log.append((prompt_ids, comp))
        return _ChatTurn(prompt_ids, comp, text, tool_calls, finish,
                         want_ids=self.cfg.token_ids and bool(body.get("return_token_ids")),
                         want_lp=self.cfg.logprobs and bool(body.get("logprobs")),
                         lps=[fake_logprob(i, t) for i, t in enumerate(comp)])

    def _lp_content(self, ids: list[int], lps: list[float]) -> dict[str, Any]:
        return {"content": [{"token": self.rnd.tok.convert_ids_to_tokens(t), "logprob": lp, "bytes": None,
                             "top_logprobs": []} for t, lp in zip(ids, lps)]}

    def _chat_json(self, turn: _ChatTurn) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": turn.text or None,
                        **({"tool_calls": turn.tool_calls} if turn.tool_calls else {})},
            "finish_reason": turn.finish,
            "logprobs": self._lp_content(turn.comp, turn.lps) if turn.want_lp else None,
        }
        out: dict[str, Any] = {"id": turn.rid, "object": "chat.completion", "created": turn.created,
                               "model": self.cfg.model, "choices": [choice],
                               "usage": _usage(turn.prompt_ids, turn.comp)}
        if turn.want_ids:
            out["prompt_token_ids"] = turn.prompt_ids
            choice["token_ids"] = turn.comp
        return out

    def _chunk(self, turn: _ChatTurn, delta: dict[str, Any], ids: list[int], offset: int,
               finish_reason: str | None = None, extra: dict[str, Any] | None = None) -> bytes:
        ch: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        if turn.want_lp:
            ch["logprobs"] = self._lp_content(ids, turn.lps[offset: offset + len(ids)])
        if turn.want_ids:
            ch["token_ids"] = ids
        obj = {"id": turn.rid, "object": "chat.completion.chunk", "created": turn.created, "model": self.cfg.model,
               "choices": [ch], **(extra or {})}
        nl = self.cfg.sse_newline
        return f"data: {json.dumps(obj)}{nl}{nl}".encode()

    async def _chat_stream(self, turn: _ChatTurn, include_usage: bool) -> AsyncIterator[bytes]:
        """Content tokens in pieces of 4, then the tool calls, then the end token with finish_reason."""
        rnd, comp = self.rnd, turn.comp
        yield self._chunk(turn, {"role": "assistant", "content": ""}, [], 0,
                          extra={"prompt_token_ids": turn.prompt_ids} if turn.want_ids else None)
        body_ids = comp[:-1] if comp and comp[-1] == rnd.im_end else comp
        text_ids = rnd.encode(turn.text)[: len(body_ids)]
        pos = 0
        while pos < len(text_ids):
            piece = text_ids[pos: pos + 4]
            yield self._chunk(turn, {"content": rnd.decode(piece)}, piece, pos)
            pos += len(piece)
            if self.cfg.chunk_delay_s:
                await asyncio.sleep(self.cfg.chunk_delay_s)
        if turn.tool_calls:
            rest = body_ids[pos:]
            for k, tc in enumerate(turn.tool_calls):
                part = rest if k == len(turn.tool_calls) - 1 else []
                yield self._chunk(turn, {"tool_calls": [{"index": k, "id": tc["id"], "type": "function",
                                                         "function": tc["function"]}]}, part, pos)
                pos += len(part)
        elif pos < len(body_ids):
            rest = body_ids[pos:]
            yield self._chunk(turn, {}, rest, pos)
            pos += len(rest)
        usage = {"usage": _usage(turn.prompt_ids, comp)} if include_usage else None
        yield self._chunk(turn, {}, comp[pos:], pos, finish_reason=turn.finish, extra=usage)
        yield f"data: [DONE]{self.cfg.sse_newline * 2}".encode()

    async def tokenize(self, request: Request):
        """vLLM's ``POST /tokenize``: a chat's (or a prompt's) token ids."""
        body = await request.json()
        if "messages" in body:
            ids = self.rnd.chat_prompt(body.get("messages") or [], body.get("tools") or None)
        else:
            ids = self.rnd.encode(str(body.get("prompt", "")))
        return {"count": len(ids), "max_model_len": self.cfg.max_context or None, "tokens": ids}

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(self, request: Request):
        body = _clean(await request.json())
        self.calls.append(body)
        await self._delay(request)
        try:
            return self._completion(body)
        except Exception as exc:  # noqa: BLE001 - any unreadable request is the client's fault
            return _refused(exc)

    def _completion(self, body: dict[str, Any]):
        rnd = self.rnd
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
        prompt_ids = rnd.encode(prompt)
        text = f" echo {hashlib.sha1(prompt.encode()).hexdigest()[:8]}."
        comp = rnd.completion(text, stop=False)
        max_tokens = int(body.get("max_tokens") or 16)
        finish = "stop"
        if len(comp) > max_tokens:
            comp, finish = comp[:max_tokens], "length"
            text = rnd.decode(comp)
        self.log.append((prompt_ids, comp))
        want_ids = self.cfg.token_ids and bool(body.get("return_token_ids"))
        want_lp = self.cfg.logprobs and body.get("logprobs") is not None
        lps = [fake_logprob(i, t) for i, t in enumerate(comp)]
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish,
                                  "logprobs": {"tokens": rnd.tok.convert_ids_to_tokens(comp),
                                               "token_logprobs": lps, "top_logprobs": None,
                                               "text_offset": []} if want_lp else None}
        if want_ids:
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = comp
        out = {"id": "cmpl-" + uuid.uuid4().hex[:16], "object": "text_completion", "created": int(time.time()),
               "model": self.cfg.model, "choices": [choice], "usage": _usage(prompt_ids, comp)}
        if not body.get("stream"):
            return JSONResponse(out)

        async def gen():
            yield f"data: {json.dumps({**out, 'choices': [dict(choice)]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")


def create_scripted_app(tokenizer, config: ScriptedConfig | None = None) -> FastAPI:
    """The FastAPI app of the scripted upstream (``/v1/chat/completions``, ``/v1/completions``).

    ``app.state.calls``: every request body; ``app.state.log``: every generation (see
    :class:`ScriptedUpstream`), for tests to compare against.
    """
    up = ScriptedUpstream(tokenizer, config)
    app = FastAPI()
    app.state.upstream, app.state.calls, app.state.log = up, up.calls, up.log

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": up.cfg.model, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await up.chat(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await up.completions(request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await up.tokenize(request)

    return app
