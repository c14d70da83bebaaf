"""Forks (``harness.mode`` with ``fork``): a main or helper session delegates a question to a subagent
session, whose answer comes back to it as a tool response (docs/algorithm.md §2).

The subagent's gain states (§4.4) follow ``harness.subagent_states``; either way ``meta["merged_at"]``
records where its result lies in the parent (the downstream credit of §4.10 replaces it).
"""

from __future__ import annotations

from mosaic.agent.episode import LiveSession, RunState
from mosaic.config.harness import TOOL_DOCS
from mosaic.trace.graph import StateRef


class ForkSessions:
    """The fork part of :class:`~mosaic.agent.harness.Harness` (a mixin: it uses the harness's ``config``,
    ``chat``, ``hooks`` and session helpers)."""

    def _delegate(self, run: RunState, live: LiveSession, question: str) -> None:
        if len(run.traj.sessions) + 1 > self.config.max_sessions:
            self._end_trajectory(run, "session_cap")
            return
        s = live.session
        system = self.hooks.system_text(self.config, live.depth + 1, TOOL_DOCS["delegate"])
        prompt, boundary = self.chat.initial_prompt(system, question)
        child = self._new_session(run, "subagent", prompt, s.id, "forks", live.depth + 1, question)
        own = self.config.subagent_states == "own"
        child.session.state_before = StateRef(session=child.session.id, upto=boundary) if own else \
            StateRef(session=s.id, upto=live.turn_start)
        child.fork_boundary = live.turn_start
        child.session.meta["forked_at"] = live.turn_start  # the parent's length where it left (any states)
        child.turn_start = boundary
        run.counters["forks"] += 1

    def _return_to_parent(self, run: RunState, child: LiveSession, answer: str | None, reason: str) -> None:
        if self.config.subagent_states == "own":  # (set before it closes: the live scorer probes it then)
            child.session.state_after = self._own_end(child)
        self._close(run, child, reason)
        parent = run.stack[-1]
        if answer is None:
            run.counters["subagent_failures"] += 1
            text = f"Error (subagent_failed): the helper stopped without an answer ({reason})."
        else:
            run.counters["subagent_answers"] += 1
            text = answer if answer.strip() else "(the helper gave an empty answer)"
        start = parent.length
        self._append(run, parent, self.chat.tool_delta(text))
        # Where its result lies in the parent (token offsets): the downstream credit replaces it (§4.10).
        child.session.meta["merged_at"] = [start, parent.length]
        if self.config.subagent_states == "merge":
            child.session.state_after = StateRef(session=parent.session.id, upto=parent.length)

    @staticmethod
    def _own_end(live: LiveSession) -> StateRef:
        """A subagent's own end state (``subagent_states=own``): its context at its last message boundary."""
        end = live.length if live.at_boundary else live.turn_start
        return StateRef(session=live.session.id, upto=None if end == live.length else end)
