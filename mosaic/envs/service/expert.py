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
plus those a compaction summary carried in that message (:func:`progress_summary` writes them as tool calls).
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


def _calls(transcript: list[tuple[str, str]], start: int) -> list[tuple[str, dict, str]]:
    """(name, arguments, result) of each tool call the assistant made from ``start`` on."""
    out = []
    for i in range(start, len(transcript)):
        role, text = transcript[i]
        parsed = parse_call(text) if role == "assistant" else None
        if parsed is not None:
            result = transcript[i + 1][1] if i + 1 < len(transcript) else ""
            out.append((*parsed, result))
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


def visit_progress(transcript: list[tuple[str, str]]) -> tuple[int | None, int | None, list[tuple[str, dict]]]:
    """``(index of the current visit's message, visit number k (0-based), the mutating calls done in it)``;
    the calls include those a compaction summary carries in that message (canonical tool-call texts, see
    :func:`progress_summary`), so a resumed session does not redo them. ``(None, None, [])`` before any visit."""
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


def progress_summary(transcript: list[tuple[str, str]]) -> str:
    """The expert's compaction summary: the actions already done in the current visit, as tool calls (what
    :func:`visit_progress` reads back after the compaction; lookups are not kept: the expert re-validates)."""
    _start, _k, done = visit_progress(transcript)
    if not done:
        return "Nothing done yet in this visit."
    return "Done in this visit: " + " ".join(tool_call_text(n, a) for n, a in done)


class ServiceExpert:
    """A scripted agent for the service family; see the module docstring."""

    def __init__(self, revalidate: bool = True):
        self.revalidate = revalidate

    def act(self, episode, transcript: list[tuple[str, str]]) -> str:
        """The next assistant message (a tool call or the answer) given the transcript so far."""
        start, k, done_calls = visit_progress(transcript)
        if start is None:
            return "<answer>unknown</answer>"
        here = _calls(transcript, start)
        looked = {n for n, _a, _r in (here if self.revalidate else _calls(transcript, 0))}
        for lookup in ("get_account", "list_orders"):
            if lookup not in looked:
                return tool_call_text(lookup, {})
        state = _belief(here, latest=True) if self.revalidate else _belief(_calls(transcript, 0), latest=False)
        if state is None:
            return "<answer>unknown</answer>"
        if self.revalidate:
            plan = visit_plan(state, episode.events_before(k), episode.visits[k].request, believe=False)
        else:  # replay what it remembers: every earlier visit's announcements and its own actions
            for j in range(k + 1):
                plan = visit_plan(state, episode.events_before(j), episode.visits[j].request, believe=True)
        done = len(done_calls)  # (those a compaction summary carried included)
        if done < len(plan):
            return tool_call_text(plan[done].name, plan[done].kw)
        if k + 1 < len(episode.visits):
            return tool_call_text("end_visit", {})
        visit = episode.visits[k]
        return f"<answer>{answer_for(state, visit.question, visit.question_item)}</answer>"


def run_episode(env: ServiceEnv, episode, agent, *, key: str | None = None, max_turns: int = 100):
    """Run ``agent`` (anything with ``act(episode, transcript)``) on ``episode``; returns the outcome.

    The loop a harness runs, without tokens: a message with an answer ends the rollout; one without a
    well-formed tool call gets an error message; a :class:`ToolError` becomes the tool's reply."""
    key = key or episode.id
    transcript = [("user", env.open(key, episode))]
    for _ in range(max_turns):
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
