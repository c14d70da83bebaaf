"""Server-sent events: the streamed forms of ``/v1/completions`` and ``/v1/chat/completions``."""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol

from mosaic.agent.server.schema import (
    ChatCompletionRequest, CompletionRequest, chat_logprob, completion_logprobs, sse, usage,
)
from mosaic.agent.server.textops import OPEN_TAG, cut_at_stop, held_back, parse_tool_calls
from mosaic.agent.server.worker import Job


class TextSource(Protocol):
    """What streaming needs of the server: its model name and its tokenizer's text."""

    model_name: str

    def decode(self, ids: list[int], skip_special: bool) -> str: ...

    def token_str(self, t: int) -> str: ...


class ChoiceText:
    """Incremental text of each streamed choice.

    A delta is held back while it ends in an incomplete UTF-8 sequence (multi-byte characters
    split over tokens stream whole), or while its end could be the start of a ``stop`` string or,
    when tool calls are parsed, of ``<tool_call>``. Once a stop string appears the choice is over:
    its text ends before it and later tokens are dropped. Once ``<tool_call>`` appears no more
    content streams: the calls are parsed from the whole reply at the end.
    """

    def __init__(self, srv: TextSource, skip_special: bool, stops: list[str] | None = None,
                 tools: bool = False) -> None:
        self.srv, self.skip = srv, skip_special
        self.stops = list(stops or [])
        self.tools = tools
        self.markers = self.stops + ([OPEN_TAG] if tools else [])
        self.ids: dict[int, list[int]] = {}
        self.sent: dict[int, str] = {}
        self.stopped: set[int] = set()
        self.in_call: set[int] = set()

    def push(self, c: int, t: int) -> str | None:
        """The text delta token ``t`` releases for choice ``c``; None once the choice has stopped."""
        if c in self.stopped:
            return None
        ids = self.ids.setdefault(c, [])
        ids.append(t)
        text = self.srv.decode(ids, self.skip)
        if text.endswith("\ufffd"):
            return ""
        hits = [text.find(s) for s in self.stops if s in text]
        if hits:
            self.stopped.add(c)
            return self._delta(c, text[: min(hits)])
        if c in self.in_call:
            return ""
        if self.tools and OPEN_TAG in text:
            self.in_call.add(c)
            return self._delta(c, text[: text.find(OPEN_TAG)])
        return self._delta(c, text[: len(text) - held_back(text, self.markers)])

    def _delta(self, c: int, upto: str) -> str:
        prev = self.sent.get(c, "")
        if len(upto) <= len(prev) or not upto.startswith(prev):
            return ""
        self.sent[c] = upto
        return upto[len(prev):]

    def finish(self, c: int, res) -> tuple[str, list[dict], str, int]:
        """At the end of choice c: the content not streamed yet, its tool calls, the finish reason
        and the completion's token count (cut at a stop string)."""
        ids, text, stopped = cut_at_stop(res.token_ids, lambda x: self.srv.decode(x, self.skip), self.stops)
        finish = "stop" if stopped else res.finish_reason
        calls: list[dict] = []
        content = text
        if self.tools:
            parsed, calls = parse_tool_calls(text)
            content = parsed or ""
            if calls and finish == "stop":
                finish = "tool_calls"
        sent = self.sent.get(c, "")
        rest = content[len(sent):] if content.startswith(sent) else ""
        return rest, calls, finish, len(ids)


async def _events(job: Job) -> AsyncIterator[tuple]:
    """Yields ("token", choice, id, lp) and finally ("done", results), or ("error", message)."""
    while True:
        ev = await job.events.get()
        if ev[0] == "error":
            yield ("error", ev[1])
            return
        yield ev
        if ev[0] == "done":
            return


def _error_event(message: str) -> str:
    return sse({"error": {"message": f"generation failed: {message}", "type": "server_error", "code": 500}})


async def stream_completion(srv: TextSource, job: Job, body: CompletionRequest, cid: str, created: int,
                            prompt_of: list[list[int]]) -> AsyncIterator[str]:
    head = {"id": cid, "object": "text_completion", "created": created, "model": srv.model_name}
    sent_prompt = set()
    text = ChoiceText(srv, body.skip_special_tokens, body.stop)
    async for ev in _events(job):
        if ev[0] == "token":
            _, c, t, lp = ev
            delta = text.push(c, t)
            if delta is None:
                continue
            choice: dict[str, Any] = {"index": c, "text": delta, "logprobs": None, "finish_reason": None}
            if body.logprobs is not None:
                choice["logprobs"] = completion_logprobs(srv.token_str, [t], [lp], body.logprobs)
            if body.return_token_ids:
                choice["token_ids"] = [t]
                if c not in sent_prompt:
                    choice["prompt_token_ids"] = prompt_of[c]
                    sent_prompt.add(c)
            yield sse({**head, "choices": [choice]})
        elif ev[0] == "done":
            results = ev[1]
            counts = []
            for c, res in enumerate(results):
                rest, _, finish, n = text.finish(c, res)
                counts.append(n)
                choice = {"index": c, "text": rest, "logprobs": None, "finish_reason": finish}
                if body.return_token_ids:
                    choice["token_ids"] = []
                    if c not in sent_prompt:
                        choice["prompt_token_ids"] = prompt_of[c]
                if res.finish_reason == "error":
                    choice["error"] = res.error
                yield sse({**head, "choices": [choice]})
            yield sse({**head, "choices": [], "usage": usage([len(p) for p in prompt_of], counts),
                       "policy_version": job.version})
        else:
            yield _error_event(ev[1])
    yield "data: [DONE]\n\n"


async def stream_chat(srv: TextSource, job: Job, body: ChatCompletionRequest, cid: str, created: int,
                      prompt_ids: list[int]) -> AsyncIterator[str]:
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": srv.model_name}
    first = {"role": "assistant", "content": ""}
    roles = [{**head, "choices": [{"index": c, "delta": first, "logprobs": None, "finish_reason": None}]}
             for c in range(body.n)]
    if body.return_token_ids:
        roles[0]["prompt_token_ids"] = prompt_ids
    for r in roles:
        yield sse(r)
    text = ChoiceText(srv, body.skip_special_tokens, body.stop, body.uses_tools)
    async for ev in _events(job):
        if ev[0] == "token":
            _, c, t, lp = ev
            delta = text.push(c, t)
            if delta is None:
                continue
            choice: dict[str, Any] = {"index": c, "delta": {"content": delta} if delta else {},
                                      "logprobs": None, "finish_reason": None}
            if body.logprobs:
                choice["logprobs"] = {"content": [chat_logprob(srv.token_str, t, lp)]}
            if body.return_token_ids:
                choice["token_ids"] = [t]
            yield sse({**head, "choices": [choice]})
        elif ev[0] == "done":
            results = ev[1]
            counts = []
            for c, res in enumerate(results):
                rest, calls, finish, n = text.finish(c, res)
                counts.append(n)
                if rest:
                    yield sse({**head, "choices": [{"index": c, "delta": {"content": rest}, "logprobs": None,
                                                    "finish_reason": None}]})
                if calls:
                    yield sse({**head, "choices": [{"index": c, "logprobs": None, "finish_reason": None, "delta": {
                        "tool_calls": [{"index": k, **tc} for k, tc in enumerate(calls)]}}]})
                yield sse({**head, "choices": [{"index": c, "delta": {}, "logprobs": None, "finish_reason": finish}]})
            yield sse({**head, "choices": [], "usage": usage([len(prompt_ids)] * len(results), counts),
                       "policy_version": job.version})
        else:
            yield _error_event(ev[1])
    yield "data: [DONE]\n\n"
