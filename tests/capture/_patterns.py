"""Scripted harnesses for the session-graph patterns real harnesses produce (issue 12).

A lead agent with a ``search`` tool and a ``researcher`` tool that runs a subagent (parallel calls
run concurrently, so their model calls interleave), and an LLM-summary conversation manager that
calls the model with its *own* system prompt and no tools. Each harness is written the way such
code is: what it re-sends is its own rendering of the history, not the sampled tokens.

The "model" is a script: each call says what it replies. :class:`ScriptLLM` renders the request
with the scripted upstream's renderer, as a vLLM-style server would, and records the call as the
proxy would (exact prompt and completion ids); past ``max_context`` (prompt + ``max_tokens``) a
call is refused like vLLM's 400 and recorded as a context overflow with its prompt ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json

from mosaic.capture.records import CallRecord
from mosaic.capture.scripted import Renderer, render_tool_calls
from mosaic.capture.scripted_server import fake_logprob

LEAD_SYS = "You are the lead researcher. Search, delegate to researchers, then answer."
SUB_SYS = "You are a researcher. Search, then report what you found."
SUMMARISER_SYS = "You condense agent conversations into short notes."
SUMMARY_ASK = "Summarize the conversation so far. Messages to summarize:\n"
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the corpus.",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}}}}}
RESEARCHER = {"type": "function", "function": {"name": "researcher", "description": "Run a researcher.",
                                               "parameters": {"type": "object", "properties": {
                                                   "question": {"type": "string"}}}}}
TOOLS_LEAD, TOOLS_SUB = [SEARCH, RESEARCHER], [SEARCH]


class ContextOverflow(Exception):
    """The upstream refused the request: prompt + max_tokens exceed the context."""


def h(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def tool_call(name: str, args: dict, key: str) -> dict:
    return {"id": "call_" + h(f"{key}:{name}:{json.dumps(args)}"), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def document(query: str, size: int = 1) -> str:
    return " ".join(f"Document {h(query + str(k))} about {query} says fact {h(query)}." for k in range(size))


class ScriptLLM:
    def __init__(self, rnd: Renderer, rollout_id: str, max_context: int | None = None):
        self.rnd, self.rid, self.max_context = rnd, rollout_id, max_context
        self.records: list[CallRecord] = []
        self._seq = itertools.count()
        self._clock = itertools.count()

    async def __call__(self, messages, tools, text: str, tool_calls=(), *, max_tokens: int = 64, cut: bool = False):
        """``cut``: the reply is cut at ``max_tokens`` (no end-of-turn token, ``finish_reason`` "length")."""
        t0 = next(self._clock)
        await asyncio.sleep(0)  # concurrent subagents interleave here
        tool_calls = list(tool_calls)
        prompt = self.rnd.chat_prompt(messages, tools)
        seq = next(self._seq)
        rec = CallRecord(call_id=f"{self.rid}-{seq}", rollout_id=self.rid, seq=seq, endpoint="chat",
                         messages=json.loads(json.dumps(messages)), tools=list(tools or []),
                         request_params={"max_tokens": max_tokens}, t_start=float(t0), t_end=t0 + 0.5)
        self.records.append(rec)
        if self.max_context is not None and len(prompt) + max_tokens > self.max_context:
            rec.status, rec.context_overflow, rec.prompt_ids = 400, True, prompt
            rec.error = (f"upstream returned 400: This model's maximum context length is {self.max_context} "
                         f"tokens. However, you requested {len(prompt) + max_tokens} tokens.")
            raise ContextOverflow(rec.error)
        comp = self.rnd.completion(text + render_tool_calls(tool_calls), stop=not cut)
        rec.prompt_ids, rec.completion_ids = prompt, comp
        rec.logprobs = [fake_logprob(i, t) for i, t in enumerate(comp)]
        rec.text, rec.tool_calls = text, tool_calls
        rec.finish_reason = "length" if cut else "tool_calls" if tool_calls else "stop"
        await asyncio.sleep(0)
        return text, tool_calls


def assistant(content, tool_calls) -> dict:
    m = {"role": "assistant", "content": content}
    if tool_calls:
        m["tool_calls"] = tool_calls
    return m


async def summarise(llm: ScriptLLM, msgs: list[dict]) -> str:
    """The conversation manager: the summariser's own system prompt, the history as text, no tools."""
    lines = []
    for m in msgs[1:]:
        lines.append(f"{m['role']}: {m.get('content') or ''}")
        for tc in m.get("tool_calls") or []:
            lines.append(f"  called {tc['function']['name']} with {tc['function']['arguments']}")
    summary = f"SUMMARY {h(''.join(lines))}: notes on {len(lines)} messages."
    await llm([{"role": "system", "content": SUMMARISER_SYS}, {"role": "user", "content": SUMMARY_ASK + "\n".join(lines)}],
              None, summary, max_tokens=16)
    return summary


async def researcher(llm: ScriptLLM, question: str, searches: int, *, compact_before: int | None = None,
                     lead_in: str = "", resend=lambda text: text) -> str:
    """A subagent: ``searches`` searches, then a result; optionally compacts its own history before
    search number ``compact_before``. ``lead_in``: text the model writes before each tool call;
    ``resend``: how the harness re-sends that text."""
    head = [{"role": "system", "content": SUB_SYS}, {"role": "user", "content": question}]
    msgs = list(head)
    for k in range(searches):
        if k == compact_before:
            summary = await summarise(llm, msgs)
            msgs = head + [{"role": "user", "content": f"Your notes so far: {summary}"}]
        t = tool_call("search", {"query": f"{question} part {k}"}, question)
        text, calls = await llm(msgs, TOOLS_SUB, lead_in, [t])
        msgs += [assistant(resend(text), calls),
                 {"role": "tool", "tool_call_id": t["id"], "content": document(f"{question} part {k}")}]
    text, _ = await llm(msgs, TOOLS_SUB, f"RESULT for {question}: fact {h(question)}")
    return text


def run(coro_fn, rnd: Renderer, rid: str, **kw) -> tuple[list[CallRecord], str]:
    llm = ScriptLLM(rnd, rid, **kw)
    answer = asyncio.run(coro_fn(llm))
    return llm.records, answer


# ------------------------------------------------------------------------------------ the patterns

TASK = "Which fact links the river and the old city?"
QA, QB = "Where does the river start?", "Who founded the old city?"


async def subagent_compacts(llm: ScriptLLM) -> str:
    """Pattern 1: two researchers in parallel; the first compacts its own history mid-way."""
    msgs = [{"role": "system", "content": LEAD_SYS}, {"role": "user", "content": TASK}]
    calls = [tool_call("researcher", {"question": q}, q) for q in (QA, QB)]
    await llm(msgs, TOOLS_LEAD, "", calls)
    results = await asyncio.gather(researcher(llm, QA, 3, compact_before=2), researcher(llm, QB, 1))
    msgs += [assistant("", calls)] + [{"role": "tool", "tool_call_id": c["id"], "content": r}
                                      for c, r in zip(calls, results)]
    t = tool_call("search", {"query": "river city link"}, "lead")
    await llm(msgs, TOOLS_LEAD, "", [t])
    msgs += [assistant("", [t]), {"role": "tool", "tool_call_id": t["id"], "content": document("river city link")}]
    answer, _ = await llm(msgs, TOOLS_LEAD, f"ANSWER: fact {h(QA)} and fact {h(QB)}")
    return answer


async def result_returned_directly(llm: ScriptLLM) -> str:
    """Pattern 2: the lead searches, hands the question to a researcher, and the harness returns the
    researcher's result to the user: no later model call sees it."""
    msgs = [{"role": "system", "content": LEAD_SYS}, {"role": "user", "content": TASK}]
    t = tool_call("search", {"query": "river"}, "lead")
    await llm(msgs, TOOLS_LEAD, "", [t])
    msgs += [assistant("", [t]), {"role": "tool", "tool_call_id": t["id"], "content": document("river")}]
    call = tool_call("researcher", {"question": QA}, QA)
    await llm(msgs, TOOLS_LEAD, "", [call])
    return await researcher(llm, QA, 1)


async def whitespace_dropped(llm: ScriptLLM) -> str:
    """Pattern 3a: the model writes whitespace before its tool calls; the harness re-sends those turns
    with no content (in the lead and in a researcher)."""
    drop = lambda text: None if not text.strip() else text  # noqa: E731
    msgs = [{"role": "system", "content": LEAD_SYS}, {"role": "user", "content": TASK}]
    call = tool_call("researcher", {"question": QA}, QA)
    text, _ = await llm(msgs, TOOLS_LEAD, "\n\n", [call])
    result = await researcher(llm, QA, 2, lead_in="\n", resend=drop)
    msgs += [assistant(drop(text), [call]), {"role": "tool", "tool_call_id": call["id"], "content": result}]
    for k in range(2):
        t = tool_call("search", {"query": f"city {k}"}, "lead")
        text, _ = await llm(msgs, TOOLS_LEAD, "\n\n", [t])
        msgs += [assistant(drop(text), [t]), {"role": "tool", "tool_call_id": t["id"], "content": document(f"city {k}")}]
    answer, _ = await llm(msgs, TOOLS_LEAD, f"ANSWER: fact {h(QA)}")
    return answer


async def leaked_markup(llm: ScriptLLM) -> str:
    """Pattern 3b: markup leaks into the lead's content (``...\\n<``) and the harness re-sends it
    stripped; the researcher's result then sits in a prompt that no tip prefixes."""
    strip = lambda text: text.rstrip("<").rstrip()  # noqa: E731
    msgs = [{"role": "system", "content": LEAD_SYS}, {"role": "user", "content": TASK}]
    call = tool_call("researcher", {"question": QA}, QA)
    text, _ = await llm(msgs, TOOLS_LEAD, "I will ask a researcher.\n<", [call])
    result = await researcher(llm, QA, 1)
    msgs += [assistant(strip(text), [call]), {"role": "tool", "tool_call_id": call["id"], "content": result}]
    answer, _ = await llm(msgs, TOOLS_LEAD, f"ANSWER: fact {h(QA)}")
    return answer


async def overflow_then_compact(llm: ScriptLLM) -> str:
    """Pattern 4: a long search result overflows the lead's context; the upstream refuses the next
    call (400); the conversation manager summarises and the lead answers from the summary."""
    head = [{"role": "system", "content": LEAD_SYS}, {"role": "user", "content": TASK}]
    msgs = list(head)
    for k, size in enumerate((1, 1, 12)):
        t = tool_call("search", {"query": f"river {k}"}, "lead")
        try:
            await llm(msgs, TOOLS_LEAD, "", [t], max_tokens=150)
        except ContextOverflow:
            raise AssertionError("overflowed too early: adjust max_context") from None
        msgs += [assistant("", [t]), {"role": "tool", "tool_call_id": t["id"], "content": document(f"river {k}", size)}]
    try:
        await llm(msgs, TOOLS_LEAD, "never sampled", max_tokens=150)
        raise AssertionError("expected a context overflow: adjust max_context")
    except ContextOverflow:
        pass
    summary = await summarise(llm, msgs)
    msgs = head + [{"role": "user", "content": f"Notes so far: {summary}"}]
    answer, _ = await llm(msgs, TOOLS_LEAD, f"ANSWER: fact {h('river 2')}", max_tokens=150)
    return answer


async def random_team(llm: ScriptLLM, plan: list[dict], lead_searches: int, lead_ws: bool) -> str:
    """A lead that runs one researcher per ``plan`` entry in parallel (``searches``, ``compact_before``,
    ``ws``: whitespace before tool calls, dropped when re-sent), then searches, then answers."""
    drop = lambda text: None if not text.strip() else text  # noqa: E731
    msgs = [{"role": "system", "content": LEAD_SYS}, {"role": "user", "content": TASK}]
    qs = [f"Question {k}: where is landmark {k}?" for k in range(len(plan))]
    calls = [tool_call("researcher", {"question": q}, q) for q in qs]
    text, _ = await llm(msgs, TOOLS_LEAD, "\n" if lead_ws else "", calls)
    results = await asyncio.gather(*(researcher(llm, q, p["searches"], compact_before=p["compact_before"],
                                                lead_in="\n" if p["ws"] else "", resend=drop)
                                     for q, p in zip(qs, plan)))
    msgs += [assistant(drop(text), calls)] + [{"role": "tool", "tool_call_id": c["id"], "content": r}
                                              for c, r in zip(calls, results)]
    for k in range(lead_searches):
        t = tool_call("search", {"query": f"lead {k}"}, "lead")
        text, _ = await llm(msgs, TOOLS_LEAD, "\n" if lead_ws else "", [t])
        msgs += [assistant(drop(text), [t]), {"role": "tool", "tool_call_id": t["id"], "content": document(f"lead {k}")}]
    answer, _ = await llm(msgs, TOOLS_LEAD, f"ANSWER: {len(plan)} researchers")
    return answer


async def cut_reply_resent(llm: ScriptLLM) -> str:
    """Issue 33 item 11, the trainer test's scripted harness (main → sub-agent → main → compaction →
    main) with its random model's luck made deterministic: every reply is cut at ``max_tokens``; the
    lead's first reply ends with a fragment the harness does not re-send as sampled (a split character,
    here a stray ``<``), and the harness attaches the delegate tool call to it itself."""
    head = [{"role": "system", "content": LEAD_SYS}, {"role": "user", "content": TASK}]
    msgs = list(head)
    call = tool_call("delegate", {"question": QA}, QA)
    text, _ = await llm(msgs, None, "I ask a helper about it <", cut=True)
    sub_answer, _ = await llm([{"role": "system", "content": SUB_SYS}, {"role": "user", "content": QA}], None,
                              "It starts high in the hills", cut=True)
    msgs += [assistant(text.rstrip("<").rstrip(), [call]),
             {"role": "tool", "tool_call_id": call["id"], "content": sub_answer}]
    text, _ = await llm(msgs, None, "Then I search the archive", cut=True)
    msgs += [assistant(text, None), {"role": "tool", "content": document("river")}]
    summary, _ = await llm(msgs + [{"role": "user", "content": "Summarize the conversation so far."}], None,
                           "Notes: the river starts in the hills", cut=True)
    answer, _ = await llm(head + [{"role": "user", "content": summary}], None, "ANSWER: the hills", cut=True)
    return answer


RESET_SYS = "You work in sessions of at most two actions. Keep notes: they are all the next session sees."
NOTE = {"type": "function", "function": {"name": "note_write", "description": "Keep a note.",
                                         "parameters": {"type": "object", "properties": {
                                             "text": {"type": "string"}}}}}
TOOLS_RESET = [SEARCH, NOTE]


async def context_resets(llm: ScriptLLM, sessions: int = 3, with_researcher: bool = False) -> str:
    """Pattern 5 (HMA-style, issue 30): the agent's context is reset every two actions; each session starts
    from the system prompt, the task and the notes written so far (note_write), nothing else. With
    ``with_researcher``: the second session also runs a researcher subagent."""
    notes: list[str] = []
    tools = TOOLS_RESET + ([RESEARCHER] if with_researcher else [])
    for s in range(sessions):
        shown = "\n".join(f"- {n}" for n in notes) or "(none)"
        msgs = [{"role": "system", "content": RESET_SYS}, {"role": "user", "content": f"{TASK}\nNotes:\n{shown}"}]
        if s == sessions - 1:
            answer, _ = await llm(msgs, tools, f"ANSWER: {' and '.join(notes)}")
            return answer
        q = f"river city part {s}"
        if with_researcher and s == 1:
            call = tool_call("researcher", {"question": QA}, QA)
            await llm(msgs, tools, "", [call])
            result = await researcher(llm, QA, 1)
            msgs += [assistant("", [call]), {"role": "tool", "tool_call_id": call["id"], "content": result}]
        else:
            t = tool_call("search", {"query": q}, f"reset{s}")
            await llm(msgs, tools, "", [t])
            msgs += [assistant("", [t]), {"role": "tool", "tool_call_id": t["id"], "content": document(q)}]
        note = f"fact {h(q)} from session {s}"
        n = tool_call("note_write", {"text": note}, f"note{s}")
        await llm(msgs, tools, "", [n])
        notes.append(note)
    raise AssertionError("unreachable")
