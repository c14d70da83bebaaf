"""Server-sent events: the streamed forms of ``/v1/completions`` and ``/v1/chat/completions``."""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol

from mosaic.agent.server.schema import (
    ChatCompletionRequest, CompletionRequest, chat_logprob, completion_logprobs, sse, usage,
)
from mosaic.agent.server.worker import Job


class TextSource(Protocol):
    """What streaming needs of the server: its model name and its tokenizer's text."""

    model_name: str

    def decode(self, ids: list[int], skip_special: bool) -> str: ...

    def token_str(self, t: int) -> str: ...


class Detok:
    """Incremental detokenisation per choice: a delta is held back while it ends in an
    incomplete UTF-8 sequence, so multi-byte characters split over tokens stream whole."""

    def __init__(self, srv: TextSource, skip_special: bool) -> None:
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
    detok = Detok(srv, body.skip_special_tokens)
    async for ev in _events(job):
        if ev[0] == "token":
            _, c, t, lp = ev
            choice: dict[str, Any] = {"index": c, "text": detok.push(c, t),
                                      "logprobs": None, "finish_reason": None}
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
            for c, res in enumerate(results):
                choice = {"index": c, "text": detok.flush(c), "logprobs": None,
                          "finish_reason": res.finish_reason}
                if body.return_token_ids:
                    choice["token_ids"] = []
                    if c not in sent_prompt:
                        choice["prompt_token_ids"] = prompt_of[c]
                if res.finish_reason == "error":
                    choice["error"] = res.error
                yield sse({**head, "choices": [choice]})
            yield sse({**head, "choices": [], "usage": usage([len(p) for p in prompt_of], results)})
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
    detok = Detok(srv, body.skip_special_tokens)
    async for ev in _events(job):
        if ev[0] == "token":
            _, c, t, lp = ev
            choice: dict[str, Any] = {"index": c, "delta": {"content": detok.push(c, t)},
                                      "logprobs": None, "finish_reason": None}
            if body.logprobs:
                choice["logprobs"] = {"content": [chat_logprob(srv.token_str, t, lp)]}
            if body.return_token_ids:
                choice["token_ids"] = [t]
            yield sse({**head, "choices": [choice]})
        elif ev[0] == "done":
            results = ev[1]
            for c, res in enumerate(results):
                rest = detok.flush(c)
                yield sse({**head, "choices": [{"index": c, "delta": {"content": rest} if rest else {},
                                                "logprobs": None, "finish_reason": res.finish_reason}]})
            yield sse({**head, "choices": [], "usage": usage([len(prompt_ids)] * len(results), results)})
        else:
            yield _error_event(ev[1])
    yield "data: [DONE]\n\n"
