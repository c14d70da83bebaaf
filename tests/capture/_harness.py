"""A small agent harness that compacts and forks, for tests (the deepagents test uses a real one).

It talks to a model through an async ``llm(messages, tools) -> (text, tool_calls)``
callable: :class:`OpenAILLM` goes through a real OpenAI client (so through the
proxy), :class:`OfflineLLM` answers with the scripted policy and writes call
records directly (for fast reconstruction tests). Subagents run concurrently
(``asyncio.gather``), so their calls interleave with each other.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

from mosaic.capture.records import CallRecord
from mosaic.capture.scripted import Renderer, decide, render_tool_calls
from mosaic.capture.scripted_server import fake_logprob

MAIN_SYSTEM = "You are a research agent. Use the tools, then answer."
SUB_SYSTEM = "You are a subagent. Research the subtask and report."
TOOLS_MAIN = [
    {"type": "function", "function": {"name": "task", "description": "Run a subagent.",
                                      "parameters": {"type": "object", "properties": {
                                          "description": {"type": "string"}, "subagent_type": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "ls", "description": "List files.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
]
TOOLS_SUB = [TOOLS_MAIN[1]]
SUMMARY_INSTRUCTION = "Summarize the conversation so far. Messages to summarize:\n"


class OfflineLLM:
    """The scripted policy, recording calls as the proxy would (no HTTP)."""

    def __init__(self, renderer: Renderer, rollout_id: str, clock=None):
        self.rnd = renderer
        self.rollout_id = rollout_id
        self.records: list[CallRecord] = []
        self._seq = itertools.count()
        self._clock = clock or itertools.count()

    async def __call__(self, messages, tools):
        t0 = next(self._clock)
        await asyncio.sleep(0)  # let concurrent subagents interleave
        text, tool_calls = decide(messages, tools)
        prompt = self.rnd.chat_prompt(messages, tools)
        comp = self.rnd.completion(text + render_tool_calls(tool_calls))
        seq = next(self._seq)
        self.records.append(CallRecord(
            call_id=f"{self.rollout_id}-{seq}", rollout_id=self.rollout_id, seq=seq, endpoint="chat",
            messages=json.loads(json.dumps(messages)), tools=tools or [], prompt_ids=prompt, completion_ids=comp,
            logprobs=[fake_logprob(i, t) for i, t in enumerate(comp)], text=text, tool_calls=tool_calls,
            finish_reason="tool_calls" if tool_calls else "stop", t_start=float(t0), t_end=float(t0) + 0.5,
        ))
        await asyncio.sleep(0)
        return text, tool_calls


class OpenAILLM:
    """Calls a chat-completions endpoint with the official ``openai`` async client."""

    def __init__(self, client, model: str = "scripted", stream: bool = False):
        self.client, self.model, self.stream = client, model, stream

    async def __call__(self, messages, tools):
        kw = {"tools": tools} if tools else {}
        if not self.stream:
            r = await self.client.chat.completions.create(model=self.model, messages=messages, **kw)
            m = r.choices[0].message
            calls = [{"id": tc.id, "type": "function",
                      "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                     for tc in (m.tool_calls or [])]
            return m.content or "", calls
        text, calls = [], {}
        stream = await self.client.chat.completions.create(model=self.model, messages=messages, stream=True, **kw)
        async for ch in stream:
            if not ch.choices:
                continue
            d = ch.choices[0].delta
            if d.content:
                text.append(d.content)
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.id or slot["id"]
                if tc.function and tc.function.name:
                    slot["function"]["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["function"]["arguments"] += tc.function.arguments
        return "".join(text), [calls[k] for k in sorted(calls)]


def _assistant(text, tool_calls):
    m = {"role": "assistant", "content": text}
    if tool_calls:
        m["tool_calls"] = tool_calls
    return m


async def run_subagent(llm, question: str, max_turns: int = 4) -> str:
    msgs = [{"role": "system", "content": SUB_SYSTEM}, {"role": "user", "content": question}]
    for _ in range(max_turns):
        text, calls = await llm(msgs, TOOLS_SUB)
        msgs.append(_assistant(text, calls))
        if not calls:
            return text
        for tc in calls:
            msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": "files: none"})
    return text


async def run_agent(llm, task: str, *, compact_after: int = 9, max_turns: int = 16) -> str:
    """Main loop: forks subagents on ``task`` calls (concurrently), compacts past ``compact_after`` messages."""
    head = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": task}]
    msgs = list(head)
    for _ in range(max_turns):
        if len(msgs) > compact_after:
            history = "\n".join(f"{m['role']}: {m.get('content') or ''}{render_tool_calls(m.get('tool_calls') or [])}"
                                for m in msgs[1:])
            summary, _ = await llm([{"role": "user", "content": SUMMARY_INSTRUCTION + history}], None)
            msgs = head + [{"role": "user", "content": f"Here is a summary of the conversation to date:\n\n{summary}"}]
        text, calls = await llm(msgs, TOOLS_MAIN)
        msgs.append(_assistant(text, calls))
        if not calls:
            return text
        subs = [tc for tc in calls if tc["function"]["name"] == "task"]
        results = await asyncio.gather(*(run_subagent(llm, json.loads(tc["function"]["arguments"])["description"])
                                         for tc in subs))
        res = {tc["id"]: r for tc, r in zip(subs, results)}
        for tc in calls:
            msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": res.get(tc["id"], "files: none")})
    return text


def offline_rollout(renderer: Renderer, rollout_id: str, task: str, **kw) -> tuple[list[CallRecord], str]:
    llm = OfflineLLM(renderer, rollout_id)
    answer = asyncio.run(run_agent(llm, task, **kw))
    return llm.records, answer


def now() -> float:
    return time.time()
