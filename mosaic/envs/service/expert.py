"""Scripted service agents, and a plain loop that runs an agent against :class:`ServiceEnv`.

Both experts read the transcript (what a model's context would hold) and the episode's request
structure (as the deep-search expert reads a question's gold chain); neither reads the backend except
through the tools.

- :class:`ServiceExpert` (``revalidate=True``): at the start of every visit it calls ``get_account``
  and ``list_orders``, then acts on what they show (plus what the user announced).
- the trusting expert (``revalidate=False``): looks the account up at the first visit only; later
  it acts on what it remembers: that lookup, what the user announced since, and its own actions.
  It fails exactly the episodes whose ``trap`` flag is set (an unannounced change it depends on).

Progress comes from the transcript: the visit is the last ``Visit k of n`` message; the actions done
in it are the mutating calls made since that message (rejected ones included: the experts never retry),
plus those a compaction summary carried in that message (:func:`progress_summary` writes them as tool calls),
or the count of planned calls done that a summary or a reset's notes carry (:func:`done_text`).

**Carried plans.** Once a visit's plan is made (from the lookups at its start), a summary or a note carries it
(:func:`plan_text`: the mutating calls in order, and the last visit's answer), and a later context goes on
with it: re-planning from a fresh lookup would read an account the expert's own actions have already
changed (a redirected order no longer needs redirecting, a cancelled item's next order looks like the one to
cancel) and redo or add actions.

**Forks** (the harness offers ``delegate``): the visit's lookups are delegated to a sub-agent that audits the
account (:data:`AUDIT_QUESTION`, :meth:`ServiceExpert.audit`) and answers with both lookups' texts
(:func:`audit_text`); a ``delegate`` call whose result reads as one (:func:`parse_audit`) counts as the two
lookups. A failed audit: the expert looks up itself.

**Context resets** (``harness.mode=reset``, :meth:`ServiceExpert.act_reset`): every session starts from the
current visit and the notes. The revalidating expert looks the account up at the visit's start, notes the
visit's plan, then after each mutating action notes how many planned calls are done (``Visit K done: N``),
handing off when the session's action cap (or its context) would otherwise cut off a note; it needs
``harness.reset_k >= 3`` (two lookups and the plan's note; later sessions act and note). The trusting
expert has nothing to trust after a reset and is not defined there.
"""

from __future__ import annotations

import json
import re

from mosaic.envs.rewards import extract_answer
from mosaic.envs.service.state import answer_for, visit_plan
from mosaic.envs.service.text import VISIT_RE, parse_account, parse_orders
from mosaic.envs.service.tools import MUTATIONS, ServiceEnv, ToolError

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def tool_call_text(name: str, arguments: dict) -> str:
    """The canonical text of a tool call with JSON arguments."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def parse_call(text: str) -> tuple[str, dict] | None:
    """``(name, arguments)`` of the first tool call in ``text``; None when there is none or it is not JSON."""
    m = _CALL.search(text)
    if m is None:
        return None
    try:
        data = json.loads(m.group(1))
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    return data["name"], data.get("arguments", {})


AUDIT_QUESTION = ("Audit the customer's account: call get_account and list_orders, then answer with both "
                  "results as the tools gave them, the orders after a line 'Orders:'.")
"""What a fork-mode expert delegates at the start of a visit (its sub-agent does the visit's two lookups)."""
_AUDIT_SPLIT = "\nOrders:\n"
_AUDIT_ORDER = re.compile(r"o\d+ \| [^|\n]+ \| [a-z]+")


def audit_text(account: str, orders: str) -> str:
    """A sub-agent's audit answer: the account and the orders as the lookups showed them, shortened so that it
    fits one turn (~150 tokens): an order's ``| ship to ...`` is left out when it is the account's address and
    written ``| ship to ditto`` when it is the previous order's."""
    acc, parsed = parse_account(account), parse_orders(orders)
    if acc is None or not parsed:
        return account.strip() + _AUDIT_SPLIT + orders.strip()
    lines, prev = [], None
    for oid, o in parsed.items():
        where = "" if o["address"] == acc["address"] else " | ship to ditto" if o["address"] == prev else \
            f" | ship to {o['address']}"
        lines.append(f"{oid} | {o['item']} | {o['status']}{where}")
        prev = o["address"]
    return account.strip() + _AUDIT_SPLIT + "\n".join(lines)


def parse_audit(text: str) -> tuple[str, str] | None:
    """``(account text, orders text)`` of an :func:`audit_text` answer, the orders as ``list_orders`` writes
    them; None when ``text`` is not one (an error message, a helper that failed or answered something else)."""
    account, sep, orders = text.strip().partition(_AUDIT_SPLIT)
    acc = parse_account(account) if sep else None
    if acc is None:
        return None
    if orders.strip() == "No orders.":
        return account.strip(), "No orders."
    lines, prev = [], None
    for line in orders.strip().splitlines():
        head, _sep, where = line.partition(" | ship to ")
        address = acc["address"] if not _sep else prev if where == "ditto" else where
        if address is None or "|" in address or not _AUDIT_ORDER.fullmatch(head):  # (a cut or garbled line)
            return None
        lines.append(f"{head} | ship to {address}")
        prev = address
    full = "\n".join(lines)
    return (account.strip(), full) if parse_orders(full) is not None else None


def _calls(transcript: list[tuple[str, str]], start: int) -> list[tuple[str, dict, str]]:
    """(name, arguments, result) of each tool call the assistant made from ``start`` on; a ``delegate`` call
    whose result is an audit (:func:`parse_audit`) also counts as the two lookups it reports."""
    out = []
    for i in range(start, len(transcript)):
        role, text = transcript[i]
        parsed = parse_call(text) if role == "assistant" else None
        if parsed is not None:
            result = transcript[i + 1][1] if i + 1 < len(transcript) else ""
            out.append((*parsed, result))
            audit = parse_audit(result) if parsed[0] == "delegate" else None
            if audit is not None:
                out += [("get_account", {}, audit[0]), ("list_orders", {}, audit[1])]
    return out


def _belief(calls: list[tuple[str, dict, str]], latest: bool) -> dict | None:
    """The account as the lookups among ``calls`` show it (the latest or the earliest of each)."""
    accounts = [parse_account(r) for n, _a, r in calls if n == "get_account"]
    orders = [parse_orders(r) for n, _a, r in calls if n == "list_orders"]
    accounts, orders = [a for a in accounts if a], [o for o in orders if o is not None]
    if not accounts or not orders:
        return None
    pick = -1 if latest else 0
    return {**accounts[pick], "orders": orders[pick]}


_PLAN = re.compile(r"Visit (\d{1,4}) plan: ")
_DONE_COUNT = re.compile(r"Visit (\d{1,4}) done: (\d{1,4})\b")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def plan_text(k: int, plan: list[tuple[str, dict]], answer: str = "") -> str:
    """The expert's note of visit ``k``'s (0-based) plan — its mutating calls in order, and for the last visit
    the answer, as one JSON object — carried through a compaction summary or a reset's notes, so a later
    context goes on with it instead of re-planning from an account its own actions have already changed. A
    note cut short (a summary's token cap) no longer parses and is ignored. Not ``<tool_call>`` texts: a note
    travels inside a ``note_write`` call, and a tool call inside a tool call would not parse."""
    return f"Visit {k + 1} plan: " + json.dumps({"calls": [[n, a] for n, a in plan], "answer": answer})


def done_text(k: int, n: int) -> str:
    """The reset-mode note that ``n`` calls of visit ``k``'s plan are done."""
    return f"Visit {k + 1} done: {n}"


def carried_plan(text: str, k: int) -> tuple[list[tuple[str, dict]], str] | None:
    """The plan (calls, answer) of visit ``k`` that ``text`` (a resumed visit's message) carries; None when it
    carries none that parses whole."""
    found = None
    for m in _PLAN.finditer(text):
        if int(m.group(1)) != k + 1:
            continue
        try:  # (non-finite numbers refused: they would go back out as invalid JSON)
            data, _end = _DECODER.raw_decode(text, m.end())
        except (ValueError, RecursionError):
            continue
        calls = data.get("calls") if isinstance(data, dict) else None
        if not isinstance(calls, list) or not isinstance(data.get("answer"), str) or not all(
                isinstance(c, list) and len(c) == 2 and c[0] in MUTATIONS and isinstance(c[1], dict) for c in calls):
            continue
        found = ([(c[0], c[1]) for c in calls], data["answer"])
    return found


def visit_progress(transcript: list[tuple[str, str]]) -> tuple[int | None, int | None, list[tuple[str, dict]]]:
    """``(index of the current visit's message, visit number k (0-based), the mutating calls done in it)``;
    the calls include those a compaction summary carries in that message (canonical tool-call texts, see
    :func:`progress_summary`), so a resumed session does not redo them. ``(None, None, [])`` before any visit.
    (A reset session's notes carry a count instead: :func:`done_count`.)"""
    starts = [(i, int(m.group(1)) - 1) for i, (role, text) in enumerate(transcript)
              if role != "assistant" and (m := VISIT_RE.match(text))]
    if not starts:
        return None, None, []
    start, k = starts[-1]
    carried = []
    for m in _CALL.finditer(transcript[start][1]):  # (only a resumed session's message holds tool calls)
        parsed = parse_call(m.group(0))
        if parsed is not None and parsed[0] in MUTATIONS:
            carried.append(parsed)
    return start, k, carried + [(n, a) for n, a, _r in _calls(transcript, start) if n in MUTATIONS]


def done_count(text: str, k: int) -> int:
    """How many of visit ``k``'s planned calls the notes in ``text`` say are done (0 when none say)."""
    return max((int(m.group(2)) for m in _DONE_COUNT.finditer(text) if int(m.group(1)) == k + 1), default=0)


def progress_summary(transcript: list[tuple[str, str]]) -> str:
    """A compaction summary without a plan: the actions already done in the current visit, as tool calls (what
    :func:`visit_progress` reads back after the compaction); lookups are not kept."""
    _start, _k, done = visit_progress(transcript)
    if not done:
        return "Nothing done yet in this visit."
    return "Done in this visit: " + " ".join(tool_call_text(n, a) for n, a in done)


class ServiceExpert:
    """A scripted agent for the service family; see the module docstring."""

    def __init__(self, revalidate: bool = True):
        self.revalidate = revalidate

    def plan(self, episode, transcript: list[tuple[str, str]], start: int, k: int, delegate: bool = False):
        """``(calls, answer)`` of visit ``k``: the plan its message carries (a summary's or the notes'), else
        the one the lookups show (the answer only for the last visit); a lookup's name when one is missing
        (``delegate``, in fork modes: ``"delegate"`` first, so a sub-agent audits the account; the expert
        looks up itself when the audit came back without one)."""
        carried = carried_plan(transcript[start][1], k)
        if carried is not None:
            return carried
        here = _calls(transcript, start)
        seen = here if self.revalidate else _calls(transcript, 0)
        looked = {n for n, _a, _r in seen}
        for lookup in ("get_account", "list_orders"):
            if lookup not in looked:
                return "delegate" if delegate and "delegate" not in looked else lookup
        state = _belief(here, latest=True) if self.revalidate else _belief(_calls(transcript, 0), latest=False)
        if state is None:
            return None
        if self.revalidate:
            plan = visit_plan(state, episode.events_before(k), episode.visits[k].request, believe=False)
        else:  # replay what it remembers: every earlier visit's announcements and its own actions
            for j in range(k + 1):
                plan = visit_plan(state, episode.events_before(j), episode.visits[j].request, believe=True)
        visit = episode.visits[k]
        answer = answer_for(state, visit.question, visit.question_item) if k + 1 == len(episode.visits) else ""
        return [(c.name, dict(c.kw)) for c in plan], answer

    def act(self, episode, transcript: list[tuple[str, str]], done: int | None = None, delegate: bool = False) -> str:
        """The next assistant message (a tool call or the answer) given the transcript so far; ``done``: how
        many planned calls are done (default: those :func:`visit_progress` finds); ``delegate``: the harness
        offers ``delegate`` (fork modes): the visit's lookups are an audit by a sub-agent (:meth:`audit`)."""
        start, k, done_calls = visit_progress(transcript)
        if start is None:
            return "<answer>unknown</answer>"
        got = self.plan(episode, transcript, start, k, delegate)
        if got is None:
            return "<answer>unknown</answer>"
        if got == "delegate":
            return tool_call_text("delegate", {"question": AUDIT_QUESTION})
        if isinstance(got, str):
            return tool_call_text(got, {})
        plan, answer = got
        if done is None:  # those a summary or a note carried (as calls or as a count), and this context's
            done = done_count(transcript[start][1], k) + len(done_calls)
        if done < len(plan):
            return tool_call_text(*plan[done])
        if k + 1 < len(episode.visits):
            return tool_call_text("end_visit", {})
        return f"<answer>{answer}</answer>"

    @staticmethod
    def audit(transcript: list[tuple[str, str]]) -> str:
        """A sub-agent's next message on an audit (:data:`AUDIT_QUESTION`): the two lookups, then the answer
        :func:`audit_text` (what :func:`parse_audit` reads back in the parent). Any other question, or a lookup
        that failed: an answer the parent does not take for an audit (it then looks up itself)."""
        if not transcript or AUDIT_QUESTION not in transcript[0][1]:
            return "<answer>unknown</answer>"
        got = {n: r for n, _a, r in _calls(transcript, 0)}
        for lookup in ("get_account", "list_orders"):
            if lookup not in got:
                return tool_call_text(lookup, {})
        return f"<answer>{audit_text(got['get_account'], got['list_orders'])}</answer>"

    def summary(self, episode, transcript: list[tuple[str, str]]) -> str:
        """The compaction summary: once the visit's plan is known, the plan and how much of it is done
        (:func:`plan_text`, :func:`done_text`; the resumed context needs no lookup), else the calls done so far
        (:func:`progress_summary`)."""
        start, k, done_calls = visit_progress(transcript)
        got = self.plan(episode, transcript, start, k) if start is not None else None
        if not isinstance(got, tuple):
            return progress_summary(transcript)
        return plan_text(k, *got) + "\n" + done_text(k, done_count(transcript[start][1], k) + len(done_calls))

    def act_reset(self, episode, transcript: list[tuple[str, str]], calls_left: int) -> str:
        """The next message of a context-reset session (see the module docstring); ``calls_left``: the actions
        the session may still take before the harness resets it (1: this one is its last)."""
        if not self.revalidate:
            raise ValueError("the trusting expert is not defined in context-reset mode (nothing survives a reset "
                             "but the notes)")
        start, k, _done = visit_progress(transcript)
        if start is None:
            return "<answer>unknown</answer>"
        message = transcript[start][1]
        here = _calls(transcript, start)
        notes = " ".join(str(a.get("text", a.get("note", ""))) for n, a, _r in here if n in ("note_write", "handoff"))
        done = done_count(message, k) + sum(n in MUTATIONS for n, _a, _r in here)  # earlier sessions' + this one's
        noted_done = done_count(message + " " + notes, k)
        got = self.plan(episode, transcript, start, k)
        write = "handoff" if calls_left <= 1 else "note_write"
        key = "note" if write == "handoff" else "text"
        if isinstance(got, tuple) and carried_plan(message + " " + notes, k) is None:
            return tool_call_text(write, {key: plan_text(k, *got)})  # the plan first: it must outlive the context
        if done > noted_done:  # an action of this session not noted yet
            return tool_call_text(write, {key: done_text(k, done)})
        text = self.act(episode, transcript, done=done)
        parsed = parse_call(text)
        if parsed is not None and parsed[0] in MUTATIONS and calls_left <= 1:  # no room left to note it
            return tool_call_text("handoff", {"note": f"Visit {k + 1}: next {parsed[0]}"})
        return text


def run_episode(env: ServiceEnv, episode, agent, *, key: str | None = None, max_turns: int | None = None):
    """Run ``agent`` (anything with ``act(episode, transcript)``) on ``episode``; returns the outcome.
    ``max_turns``: default 20 per visit plus 20 (the expert takes 9-19 turns for two visits), so a long
    episode is not cut by a fixed cap.

    The loop a harness runs, without tokens: a message with an answer ends the rollout; one without a
    well-formed tool call gets an error message; a :class:`ToolError` becomes the tool's reply."""
    key = key or episode.id
    transcript = [("user", env.open(key, episode))]
    for _ in range(max_turns if max_turns is not None else 20 * len(episode.visits) + 20):
        text = agent.act(episode, transcript)
        transcript.append(("assistant", text))
        if extract_answer(text)[1] in ("ok", "empty"):
            return env.finish(key, text)
        parsed = parse_call(text)
        if parsed is None:
            result = "Error (no_action): make one tool call or answer with <answer>...</answer>."
        else:
            try:
                result = env.call(key, *parsed)
            except ToolError as exc:
                result = f"Error (tool_error): {exc}"
        transcript.append(("tool", result))
    return env.finish(key, None)
