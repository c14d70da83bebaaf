"""The state of multi-session rollouts in progress, as the harness (:mod:`mosaic.agent.harness`) keeps
it: the environment adapter, a session in progress (:class:`LiveSession`), a trajectory in progress
(:class:`RunState`), what a live gain scorer is told (:class:`StateScorer`), and the check every policy
result passes (:func:`check_result`)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from mosaic.agent.policy import GenRequest, GenResult
from mosaic.envs.search import format_hits
from mosaic.trace.graph import Session, Trajectory

__all__ = ["DeepSearchEnv", "LiveSession", "RunState", "StateScorer", "check_result"]


class DeepSearchEnv:
    """Thin adapter over the deep-search environment: a ``Split`` or a ``SearchIndex``."""

    def __init__(self, split_or_index):
        self.index = getattr(split_or_index, "index", split_or_index)
        self.tasks = getattr(split_or_index, "tasks", None)
        if not hasattr(self.index, "search"):
            raise TypeError(f"DeepSearchEnv needs a Split or SearchIndex, got {type(split_or_index).__name__}")

    def search(self, query: str, k: int) -> str:
        return format_hits(self.index.search(query, k))


@dataclass
class LiveSession:
    """A session in progress."""

    session: Session
    key: str
    depth: int
    question: str
    at_boundary: bool = False  # True when the next request must first append a generation header
    turn_start: int = 0  # context length before the current turn's header (the pre-turn boundary)
    fork_boundary: int = 0  # (subagent) parent's pre-turn boundary at the delegate call

    @property
    def length(self) -> int:
        return len(self.session.prompt_ids) + len(self.session.completion_ids)


@dataclass
class RunState:
    """One trajectory in progress."""

    traj: Trajectory
    task: object
    sample: int
    question: str = ""  # the task's question, made safe
    stack: list[LiveSession] = field(default_factory=list)
    done: bool = False
    total_turns: int = 0
    counters: Counter = field(default_factory=Counter)
    invalid: Counter = field(default_factory=Counter)
    tool_calls: Counter = field(default_factory=Counter)


class StateScorer(Protocol):
    """What the harness tells a live gain scorer (:class:`mosaic.train.scorer.LiveScorer`)."""

    def session_closed(self, traj: Trajectory, session: Session, session_key: str, cuts: list[int], *,
                       next_key: str | None = None) -> None:
        """``session`` (of ``traj``) has closed; ``cuts`` are the lengths of the states that lie in it
        (prefixes of its tokens); the policy still holds its cache under ``session_key``; ``next_key``: the
        session that takes its cache over (a compaction, whose prompt extends its context)."""
        ...

    def flush(self) -> None:
        """A round of turns is over (called before the next round's requests are sent)."""
        ...


def check_result(req: GenRequest, res: GenResult) -> None:
    """A policy's result must respect the turn cap and carry one finite log-prob per token."""
    n = len(res.token_ids)
    if n > req.max_new_tokens or len(res.logprobs) != n:
        raise RuntimeError(
            f"policy returned {n} tokens / {len(res.logprobs)} logprobs for a turn capped "
            f"at {req.max_new_tokens} tokens (session {req.session_key})")
    if not all(math.isfinite(x) for x in res.logprobs):
        raise RuntimeError(f"policy returned non-finite logprobs (session {req.session_key})")
