"""A scripted, deterministic OpenAI-compatible server: try ``mosaic proxy`` without a model, and
the upstream of the project's own tests and benchmarks (``mosaic proxy scripted-upstream``).

It behaves like vLLM where the proxy cares: it renders the chat into a prompt
with a ChatML-style template, tokenizes it with a small real tokenizer (the
project's byte-level BPE trained here on a fixed corpus, see :func:`build_tokenizer`),
and returns ``prompt_token_ids`` and per-choice ``token_ids`` when asked
(``return_token_ids``) plus sampling log-probs (``logprobs``), streamed or not.
Instead of a model it decides its reply from the request (:func:`decide`):

- a request whose last message asks for a summary gets a summary listing the
  ``FACT-…`` markers it can see;
- a main agent with a ``task`` tool first forks two subagents in one turn
  (parallel tool calls), then lists files until it sees a summary, then
  answers;
- a subagent (its first user message starts with ``SUBTASK``) lists files once
  and returns a ``FACT-…`` result;
- anything else gets a deterministic echo;
- model ``fail-NNN`` gets HTTP status NNN (for fault tests).

Prompt rendering is per segment and the tokenizer isolates newlines, so a
conversation re-rendered with the assistant's reply appended starts with the
exact ids of the previous prompt + completion — the property a real server
with a stable chat template has, and the one session reconstruction relies on.

Serve it in-process with :class:`mosaic.serving.ServerThread`; save its tokenizer with
:func:`mosaic.agent.tokenizer.save_tokenizer` (what ``mosaic proxy --tokenizer DIR`` loads).
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

from mosaic.agent.tokenizer import train_tokenizer
from mosaic.capture.records import content_text

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = """The quick brown fox jumps over the lazy dog. Find the fact about the river and the city.
You are a helpful research agent. Use the tools to look up facts, then answer the question.
SUBTASK: research the topic and report the FACT marker you find. RESULT ANSWER SUMMARY
Here is a summary of the conversation to date. Messages to summarize: user assistant tool system
{"name": "task", "arguments": {"description": "research", "subagent_type": "general-purpose"}}
<tool_call> </tool_call> ls read_file write_file path / files: none 0123456789 alpha beta gamma delta
"""


def build_tokenizer(vocab_size: int = 800):
    """The scripted model's tokenizer: the project BPE (:func:`mosaic.agent.tokenizer.train_tokenizer`)
    on a fixed corpus, newlines isolated (rendering segment by segment gives the ids of the whole),
    no tag tokens, and this module's ChatML template with a ``tools`` header."""
    return train_tokenizer([_CORPUS] * 4, vocab_size, min_frequency=0, tag_tokens=(),
                           chat_template=CHAT_TEMPLATE, isolate_newlines=True)


# --------------------------------------------------------------------------- rendering


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    out = []
    for tc in tool_calls or []:
        fn = tc.get("function") or {}
        args = fn.get("arguments") or "{}"
        try:
            args_obj = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            args_obj = args
        out.append("<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args_obj},
                                             ensure_ascii=False) + "</tool_call>")
    return "".join(out)


def message_body(m: dict[str, Any]) -> str:
    return content_text(m.get("content")) + render_tool_calls(m.get("tool_calls") or [])


class Renderer:
    """Turns chats into token ids, segment by segment (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        ids = self._cache.get(text)
        if ids is None:
            ids = self.tok.encode(text, add_special_tokens=False)
            if len(self._cache) < 4096:
                self._cache[text] = ids
        return list(ids)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        ids: list[int] = []
        if tools:
            names = ",".join((t.get("function") or {}).get("name", "") for t in tools)
            ids += [self.im_start] + self.encode("tools\n") + self.encode(names) + [self.im_end] + self.encode("\n")
        for m in messages:
            ids += [self.im_start] + self.encode(f"{m.get('role', 'user')}\n") + self.encode(message_body(m))
            ids += [self.im_end] + self.encode("\n")
        ids += [self.im_start] + self.encode("assistant\n")
        return ids

    def completion(self, body: str, *, stop: bool = True) -> list[int]:
        return self.encode(body) + ([self.im_end] if stop else [])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


# --------------------------------------------------------------------------- the script


SUMMARY_RE = re.compile(r"(?i)(messages to summari[sz]e|summari[sz]e the conversation|write a summary)")
FACT_RE = re.compile(r"FACT-[0-9a-f]{6}")


def fact_for(text: str) -> str:
    return "FACT-" + hashlib.sha1(text.encode()).hexdigest()[:6]


def _tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    return [(t.get("function") or {}).get("name", "") for t in tools or []]


def _call(name: str, args: dict[str, Any], key: str) -> dict[str, Any]:
    cid = "call_" + hashlib.sha1(f"{key}:{name}:{json.dumps(args, sort_keys=True)}".encode()).hexdigest()[:12]
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def decide(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[str, list[dict[str, Any]]]:
    """The scripted policy: (text, tool_calls) for a chat request (see the module docstring)."""
    names = _tool_names(tools)
    last = messages[-1] if messages else {}
    last_text = content_text(last.get("content"))
    all_text = "\n".join(message_body(m) for m in messages)
    key = hashlib.sha1(all_text.encode()).hexdigest()[:8]
    if last.get("role") == "user" and SUMMARY_RE.search(last_text):
        facts = sorted(set(FACT_RE.findall(last_text)))
        return f"SUMMARY {key}: the subagents found {' '.join(facts) or 'nothing'}; keep listing files, then answer.", []
    users = [content_text(m.get("content")) for m in messages if m.get("role") == "user"]
    first_user = users[0] if users else ""
    n_tool = sum(1 for m in messages if m.get("role") == "tool")
    if first_user.startswith("SUBTASK"):
        if n_tool == 0 and "ls" in names:
            return "", [_call("ls", {"path": "/"}, key)]
        return f"RESULT {fact_for(first_user)} for: {first_user[:40]}", []
    if "task" in names:
        summarised = any("summary" in u.lower() and "SUMMARY" in u for u in users)
        task_called = any(
            (tc.get("function") or {}).get("name") == "task"
            for m in messages if m.get("role") == "assistant" for tc in (m.get("tool_calls") or [])
        )
        if not summarised and not task_called:
            topic = hashlib.sha1(first_user.encode()).hexdigest()[:4]
            return "", [
                _call("task", {"description": f"SUBTASK alpha-{topic}: find the first fact.",
                               "subagent_type": "general-purpose"}, key + "a"),
                _call("task", {"description": f"SUBTASK beta-{topic}: find the second fact.",
                               "subagent_type": "general-purpose"}, key + "b"),
            ]
        # Count tool results after the last summary (or from the start).
        start = 0
        for i, m in enumerate(messages):
            if m.get("role") == "user" and "SUMMARY" in content_text(m.get("content")):
                start = i
        listed = sum(1 for m in messages[start:] if m.get("role") == "tool")
        if ("ls" in names) and ((not summarised and listed < 12) or (summarised and listed < 1)):
            return "", [_call("ls", {"path": "/"}, key + str(listed))]
        facts = sorted(set(FACT_RE.findall(all_text)))
        return f"ANSWER: {' '.join(facts) or 'unknown'}", []
    return f"Echo {key}: {last_text[:60]}", []


# --------------------------------------------------------------------------- the server


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


def _fake_logprob(i: int, tok: int) -> float:
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
                         lps=[_fake_logprob(i, t) for i, t in enumerate(comp)])

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
        lps = [_fake_logprob(i, t) for i, t in enumerate(comp)]
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
