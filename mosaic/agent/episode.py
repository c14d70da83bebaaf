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

__all__ = ["DeepSearchEnv", "EnvHooks", "LiveSession", "RunState", "StateScorer", "check_result"]


def make_env(split):
    """The harness's environment for a split of either family: :class:`DeepSearchEnv` over a deep-search
    split, :class:`mosaic.envs.service.ServiceEnv` over a service split's episodes."""
    if getattr(split, "family", "deepsearch") == "service":
        from mosaic.envs.service import ServiceEnv

        return ServiceEnv(split.tasks)
    return DeepSearchEnv(split)


class DeepSearchEnv:
    """Thin adapter over the deep-search environment: a ``Split`` or a ``SearchIndex``."""

    def __init__(self, split_or_index):
        self.index = getattr(split_or_index, "index", split_or_index)
        self.tasks = getattr(split_or_index, "tasks", None)
        if not hasattr(self.index, "search"):
            raise TypeError(f"DeepSearchEnv needs a Split or SearchIndex, got {type(split_or_index).__name__}")

    def search(self, query: str, k: int) -> str:
        return format_hits(self.index.search(query, k))


class EnvHooks:
    """The optional hooks of a multi-tool environment (:class:`mosaic.envs.service.ServiceEnv`), as the
    harness uses them; an environment without them (deep search) is driven as before.

    - ``tool_names``: tools whose arguments are a JSON object (checked by the environment);
    - ``open(key, task)``: a rollout starts (a fresh backend per trajectory id);
    - ``call(key, name, arguments) -> str``: one tool call (an exception is a counted tool error);
    - ``finish(key, text)``: the rollout ends (``text``: the answering message, None when it ended
      otherwise); its result's ``reward`` replaces the answer score, its ``to_dict()`` lands in
      ``traj.meta["env"]``;
    - ``tool_docs() -> str``: replaces ``{tools}`` in the system prompts (plus ``delegate`` in fork modes);
    - ``system_rules``: text appended to the system prompts (the service family's rules);
    - ``current_question(key) -> str``: what the task asks now (restated after a compaction).
    """

    def __init__(self, env):
        self.env = env
        self.tools: tuple[str, ...] = tuple(getattr(env, "tool_names", ()) or ())
        self.finishes = callable(getattr(env, "finish", None))

    def open(self, key: str, task) -> None:
        opener = getattr(self.env, "open", None)
        if callable(opener):
            opener(key, task)

    def call(self, key: str, name: str, arguments: dict) -> str:
        return self.env.call(key, name, arguments)

    def finish(self, key: str, text: str | None) -> dict:
        out = self.env.finish(key, text)
        return out.to_dict() if hasattr(out, "to_dict") else dict(out)

    def question(self, key: str, first: str) -> str:
        """What the task asks now: the environment's ``current_question(key)`` (a service episode's current
        visit, restated after a compaction), else ``first`` (deep search: the question never changes)."""
        now = getattr(self.env, "current_question", None)
        return now(key) if callable(now) else first

    def system_text(self, cfg, depth: int, delegate_doc: str) -> str:
        docs = getattr(self.env, "tool_docs", None)
        if not callable(docs):
            return cfg.system_text(depth)
        tmpl = cfg.system_prompt if depth == 0 else cfg.subagent_system_prompt
        from mosaic.config.harness import TOOL_DOCS

        text = docs() + "".join("\n" + (delegate_doc if t == "delegate" else TOOL_DOCS[t])
                                for t in cfg.tools(depth) if t != "search")
        rules = getattr(self.env, "system_rules", "")  # (the service family's rules of the business)
        out = tmpl.replace("{tools}", text)
        return out + f"\n{rules}" if rules and rules not in out else out


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
    notes: list[str] = field(default_factory=list)  # (mode=reset) the workspace, kept across sessions


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
