"""A scripted, deterministic OpenAI-compatible server: the upstream for tests and benchmarks.

It behaves like vLLM where the proxy cares: it renders the chat into a prompt
with a ChatML-style template, tokenizes it with a small real tokenizer (a
byte-level BPE trained here, see :func:`build_tokenizer`), and returns
``prompt_token_ids`` and per-choice ``token_ids`` when asked
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
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request  # module level: FastAPI resolves route annotations by name

from mosaic.capture.records import content_text

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
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
    """A small byte-level BPE tokenizer (HF ``PreTrainedTokenizerFast``) with a ChatML template.

    Newlines are isolated before byte-level pre-tokenization, so tokenizing a
    rendered chat in one go gives the same ids as tokenizing its segments.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(path: str | Path):
    """Build the test tokenizer and save it to ``path`` (a directory); return it."""
    tok = build_tokenizer()
    tok.save_pretrained(str(path))
    return tok


def load_tokenizer(path: str | Path):
    # PreTrainedTokenizerFast, not AutoTokenizer: see the tokenizer swap pitfall in NOTES.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


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
    """

    token_ids: bool = True
    logprobs: bool = True
    delay_s: float = 0.0
    slots: int = 0
    chunk_delay_s: float = 0.0
    model: str = "scripted"


def _fake_logprob(i: int, tok: int) -> float:
    return -0.05 - 0.01 * ((tok + i) % 7)


def create_scripted_app(tokenizer, config: ScriptedConfig | None = None):
    """The FastAPI app of the scripted upstream (``/v1/chat/completions``, ``/v1/completions``)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    cfg = config or ScriptedConfig()
    rnd = Renderer(tokenizer)
    app = FastAPI()
    app.state.calls = []  # every request body, for tests to compare against
    app.state.log = []  # (prompt ids, completion ids) of every generation: what the "model" saw and produced

    sem = asyncio.Semaphore(cfg.slots) if cfg.slots > 0 else None

    async def _delay(request: Request) -> None:
        d = float(request.headers.get("x-scripted-delay", cfg.delay_s))
        if sem is not None:
            async with sem:
                await asyncio.sleep(d)
        elif d > 0:
            await asyncio.sleep(d)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.calls.append(body)
        m = re.fullmatch(r"fail-(\d{3})", str(body.get("model", "")))
        if m:  # an upstream error on request, for fault tests
            code = int(m.group(1))
            return JSONResponse({"error": {"message": f"scripted failure {code}", "type": "scripted"}},
                                status_code=code)
        await _delay(request)
        messages, tools = body.get("messages") or [], body.get("tools") or None
        text, tool_calls = decide(messages, tools)
        prompt_ids = rnd.chat_prompt(messages, tools)
        full_body = text + render_tool_calls(tool_calls)
        comp = rnd.completion(full_body)
        finish = "tool_calls" if tool_calls else "stop"
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and len(comp) > int(max_tokens):
            comp, finish, tool_calls = comp[: int(max_tokens)], "length", []
            text = rnd.decode([t for t in comp if t != rnd.im_end])
        app.state.log.append((prompt_ids, comp))
        want_ids = cfg.token_ids and bool(body.get("return_token_ids"))
        want_lp = cfg.logprobs and bool(body.get("logprobs"))
        lps = [_fake_logprob(i, t) for i, t in enumerate(comp)]
        rid = "chatcmpl-" + uuid.uuid4().hex[:16]
        created = int(time.time())
        if not body.get("stream"):
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text or None,
                            **({"tool_calls": tool_calls} if tool_calls else {})},
                "finish_reason": finish,
                "logprobs": {"content": [{"token": rnd.tok.convert_ids_to_tokens(t), "logprob": lp,
                                          "bytes": None, "top_logprobs": []} for t, lp in zip(comp, lps)]}
                if want_lp else None,
            }
            out: dict[str, Any] = {
                "id": rid, "object": "chat.completion", "created": created, "model": cfg.model,
                "choices": [choice],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(comp),
                          "total_tokens": len(prompt_ids) + len(comp)},
            }
            if want_ids:
                out["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = comp
            return JSONResponse(out)

        def chunk(delta: dict[str, Any], ids: list[int], offset: int, finish_reason=None, extra=None) -> bytes:
            ch: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            if want_lp:
                ch["logprobs"] = {"content": [{"token": rnd.tok.convert_ids_to_tokens(t), "logprob": lps[offset + j],
                                               "bytes": None, "top_logprobs": []} for j, t in enumerate(ids)]}
            if want_ids:
                ch["token_ids"] = ids
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": cfg.model,
                   "choices": [ch], **(extra or {})}
            return f"data: {json.dumps(obj)}\n\n".encode()

        async def gen():
            yield chunk({"role": "assistant", "content": ""}, [], 0,
                        extra={"prompt_token_ids": prompt_ids} if want_ids else None)
            # Content tokens in pieces of 4, then the tool calls, then the end token with finish_reason.
            body_ids = comp[:-1] if comp and comp[-1] == rnd.im_end else comp
            text_ids = rnd.encode(text)[: len(body_ids)]
            pos = 0
            while pos < len(text_ids):
                piece = text_ids[pos: pos + 4]
                yield chunk({"content": rnd.decode(piece)}, piece, pos)
                pos += len(piece)
                if cfg.chunk_delay_s:
                    await asyncio.sleep(cfg.chunk_delay_s)
            if tool_calls:
                rest = body_ids[pos:]
                for k, tc in enumerate(tool_calls):
                    part = rest if k == len(tool_calls) - 1 else []
                    yield chunk({"tool_calls": [{"index": k, "id": tc["id"], "type": "function",
                                                 "function": tc["function"]}]}, part, pos)
                    pos += len(part)
            elif pos < len(body_ids):
                rest = body_ids[pos:]
                yield chunk({}, rest, pos)
                pos += len(rest)
            tail = comp[pos:]
            usage = None
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(comp),
                                   "total_tokens": len(prompt_ids) + len(comp)}}
            yield chunk({}, tail, pos, finish_reason=finish, extra=usage)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.calls.append(body)
        await _delay(request)
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
        app.state.log.append((prompt_ids, comp))
        want_ids = cfg.token_ids and bool(body.get("return_token_ids"))
        want_lp = cfg.logprobs and body.get("logprobs") is not None
        lps = [_fake_logprob(i, t) for i, t in enumerate(comp)]
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish,
                                  "logprobs": {"tokens": rnd.tok.convert_ids_to_tokens(comp),
                                               "token_logprobs": lps, "top_logprobs": None,
                                               "text_offset": []} if want_lp else None}
        if want_ids:
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = comp
        out = {"id": "cmpl-" + uuid.uuid4().hex[:16], "object": "text_completion", "created": int(time.time()),
               "model": cfg.model, "choices": [choice],
               "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(comp),
                         "total_tokens": len(prompt_ids) + len(comp)}}
        if not body.get("stream"):
            return JSONResponse(out)

        async def gen():
            piece = dict(choice)
            yield f"data: {json.dumps({**out, 'choices': [piece]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app
