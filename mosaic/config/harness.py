"""Harness settings: :class:`HarnessConfig` (a frozen, validated dataclass) and the default prompts."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, Sequence


TOOL_DOCS: dict[str, str] = {
    "search": '- search(query): the best-matching encyclopedia passages. '
              'Example: <tool_call>{"name": "search", "arguments": {"query": "NAME relation"}}</tool_call>',
    "delegate": '- delegate(question): a helper answers a sub-question with its own searches and '
                'returns its answer. Example: <tool_call>{"name": "delegate", "arguments": '
                '{"question": "Who is the founder of NAME?"}}</tool_call>',
    "note_write": '- note_write(text): keep a note; notes survive a reset of your context. Example: '
                  '<tool_call>{"name": "note_write", "arguments": {"text": "NAME founder: NAME"}}</tool_call>',
    "handoff": '- handoff(note): a last note, then a fresh session. Example: '
               '<tool_call>{"name": "handoff", "arguments": {"note": "next: NAME country"}}</tool_call>',
}
"""How each tool is described to the model (a fixed text of the harness, like the prompts below)."""

Mode = Literal["single", "compaction", "fork", "compaction+fork", "reset"]
MODES = ("single", "compaction", "fork", "compaction+fork", "reset")

DEFAULT_SYSTEM_PROMPT = (
    "You answer questions about a fictional world by searching its encyclopedia.\n"
    "Tools:\n{tools}\n"
    "Make one tool call per turn. Each question needs several searches, one per step of its chain; "
    "search for an entity name plus a relation word. "
    "When you know the answer, reply with <answer>NAME</answer>, giving the entity's full name."
)
DEFAULT_SUBAGENT_PROMPT = (
    "You are a helper. Answer one sub-question about a fictional world by searching its encyclopedia.\n"
    "Tools:\n{tools}\n"
    "Make one tool call per turn. When you know the answer, reply with <answer>NAME</answer>."
)
DEFAULT_COMPACTION_PROMPT = (
    "Your context is full and will be cleared. Write a short summary for yourself: the entities you "
    "have found so far and the next search to make. Do not call tools."
)
DEFAULT_RESUME_TEMPLATE = "{question}\n\nYour notes so far (your earlier context was cleared):\n{summary}"
DEFAULT_RESET_TEMPLATE = "{question}\n\nNotes ({k} tool calls per session):\n{notes}"


@dataclass(frozen=True)
class HarnessConfig:
    """Every setting of the agent loop (validated at construction)."""

    mode: Mode = "compaction"
    """``single`` (no compaction, no forks: plain GRPO), ``compaction``, ``fork``, ``compaction+fork`` or
    ``reset`` (HMA: every session starts from a fresh context holding the question and the notes workspace)."""
    context_budget: int = 1024
    """Tokens a main session's context may reach, counting the next turn's ``max_new_tokens``."""
    max_new_tokens: int = 128
    """Cap on sampled tokens per assistant turn (main and subagent sessions)."""
    summary_max_new_tokens: int = 160
    """Cap on the summary a compaction session writes."""
    max_turns: int = 12
    """Assistant turns per main session; reaching it ends the trajectory (``turn_cap``)."""
    max_sessions: int = 12
    """Sessions (all kinds) per trajectory; needing more ends it unanswered (``session_cap``)."""
    max_total_turns: int = 48
    """Main + subagent turns per trajectory (``total_turn_cap``)."""
    max_total_tokens: int = 0
    """Tokens the policy may sample per trajectory, all sessions together (summaries and notes included); a
    session about to take a turn past it ends the trajectory (``token_cap``; the last turn may overshoot by
    at most ``max_new_tokens``). 0 = no cap. Compares modes at the same total budget."""
    subagent_max_turns: int = 6
    """Assistant turns per subagent session."""
    subagent_context_budget: int = 0
    """A subagent's context budget; 0 = ``context_budget``."""
    max_depth: int = 1
    """Subagent nesting depth: a session at this depth cannot delegate (error response)."""
    subagent_states: Literal["merge", "own"] = "merge"
    """A subagent's gain states (docs/algorithm.md §4.4): ``merge`` = the parent's context before the delegate
    call and right after the result is appended; ``own`` = the subagent's own prompt and its own end (what
    the helper's context says about the task's answer)."""
    search_k: int = 3
    """Hits per search."""
    max_arg_chars: int = 512
    """Longest accepted tool argument (characters)."""
    reward_metric: Literal["em", "f1"] = "em"
    """Outcome reward: exact match or token F1 (docs/algorithm.md §3)."""
    success_threshold: float = 1.0
    """``success = reward >= success_threshold``."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """Main sessions' system prompt; ``{tools}`` is replaced by the tools of the mode."""
    subagent_system_prompt: str = DEFAULT_SUBAGENT_PROMPT
    """Subagent sessions' system prompt; ``{tools}`` as above."""
    compaction_prompt: str = DEFAULT_COMPACTION_PROMPT
    """The user turn that asks for the summary."""
    resume_template: str = DEFAULT_RESUME_TEMPLATE
    """A post-compaction main session's user message; ``{question}`` and ``{summary}``."""
    reset_k: int = 4
    """``mode=reset``: tool calls (actions) per session, HMA's cap, at least 2; the session then ends and the
    next starts from a fresh context (``reset_cap``)."""
    reset_context_budget: int = 1024
    """``mode=reset``: a reset session's context budget (0 = ``context_budget``). Its prompt carries three
    tools and the notes, and a session needs room for a few searches and notes before its context
    resets; at the cpu preset's 512 tokens the scripted expert cannot note what a search found."""
    workspace_chars: int = 600
    """``mode=reset``: the notes workspace's size budget in characters, at least 32; a note that would exceed
    it is refused with an error the model reads (``workspace_full``, counted)."""
    reset_template: str = DEFAULT_RESET_TEMPLATE
    """A reset session's user message; ``{question}``, ``{notes}`` (the rendered workspace) and ``{k}``."""
    reset_roles: tuple[str, ...] = ()
    """``mode=reset``: two role descriptions that alternate from session to session (HMA's two agents;
    session 0 plays the first), each added to the system prompt as ``Your role: ...``; empty = one role."""
    partner: Literal["self", "frozen", "expert"] = "self"
    """``mode=reset`` with ``reset_roles``: who plays the second role — the policy being trained (both
    roles trained), a frozen copy of the warm start, or the scripted expert. A partner's sessions are in the
    graph (and scored) but give no training tokens."""

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ValueError(f"HarnessConfig.{name}: {why} (got {getattr(self, name)!r})")

        need(self.mode in MODES, "mode", f"must be one of {MODES}")
        for name in ("context_budget", "max_new_tokens", "summary_max_new_tokens", "max_turns",
                     "max_sessions", "max_total_turns", "subagent_max_turns", "search_k", "max_arg_chars"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "must be an int >= 1")
        need(self.subagent_context_budget >= 0, "subagent_context_budget", "must be >= 0 (0 = context_budget)")
        need(self.reset_context_budget >= 0, "reset_context_budget", "must be >= 0 (0 = context_budget)")
        need(self.max_depth >= 0, "max_depth", "must be >= 0")
        need(isinstance(self.max_total_tokens, int) and self.max_total_tokens >= 0, "max_total_tokens",
             "must be an int >= 0 (0 = no cap)")
        need(self.subagent_states in ("merge", "own"), "subagent_states", "must be 'merge' or 'own'")
        need(self.max_new_tokens < self.context_budget, "max_new_tokens", "must be < context_budget")
        for kind, knob in (("reset", "reset_context_budget"), ("subagent", "subagent_context_budget")):
            if (self.resets if kind == "reset" else self.forks) and getattr(self, knob):
                need(self.max_new_tokens < self.budget(kind), "max_new_tokens", f"must be < {knob}")
        need(self.reward_metric in ("em", "f1"), "reward_metric", "must be 'em' or 'f1'")
        need(0.0 < self.success_threshold <= 1.0, "success_threshold", "must be in (0, 1]")
        need("{tools}" in self.system_prompt, "system_prompt", "must contain the {tools} placeholder")
        need("{tools}" in self.subagent_system_prompt, "subagent_system_prompt", "must contain {tools}")
        need("{question}" in self.resume_template and "{summary}" in self.resume_template,
             "resume_template", "must contain {question} and {summary}")
        if self.compacts:
            need(self.max_sessions >= 3, "max_sessions", "compaction needs room for main → compaction → main")
        need(isinstance(self.reset_k, int) and self.reset_k >= 2, "reset_k",
             "must be an int >= 2 (a session needs room to find something and note it)")
        need(isinstance(self.workspace_chars, int) and self.workspace_chars >= 32, "workspace_chars",
             "must be an int >= 32 (room for one short note; a smaller workspace refuses every note)")
        need("{question}" in self.reset_template and "{notes}" in self.reset_template,
             "reset_template", "must contain {question} and {notes}")
        need(len(self.reset_roles) in (0, 2) and all(isinstance(r, str) and r.strip() for r in self.reset_roles),
             "reset_roles", "must be empty or two non-empty role descriptions")
        need(not self.reset_roles or self.resets, "reset_roles", "needs mode='reset'")
        need(self.partner in ("self", "frozen", "expert"), "partner", "must be 'self', 'frozen' or 'expert'")
        need(self.partner == "self" or (self.resets and bool(self.reset_roles)), "partner",
             "a frozen or expert partner plays the second of reset_roles: needs mode='reset' and two reset_roles")

    @property
    def compacts(self) -> bool:
        return self.mode in ("compaction", "compaction+fork")

    @property
    def forks(self) -> bool:
        return self.mode in ("fork", "compaction+fork")

    def budget(self, kind: str) -> int:
        """The context budget of a session of ``kind`` (a subagent's may differ from a main's)."""
        if kind == "subagent":
            return self.subagent_context_budget or self.context_budget
        return (self.reset_context_budget or self.context_budget) if kind == "reset" else self.context_budget

    @property
    def resets(self) -> bool:
        return self.mode == "reset"

    def idle_reset_note(self, ref: "HarnessConfig") -> str | None:
        """A note naming the reset-only settings changed from ``ref`` (the preset's) when the harness does not
        reset, where they run and do nothing (``reset_roles`` and ``partner`` are refused there instead)."""
        idle = [f"harness.{k}" for k in ("reset_k", "reset_context_budget", "workspace_chars", "reset_template")
                if getattr(self, k) != getattr(ref, k)]
        if self.resets or not idle:
            return None
        one = len(idle) == 1
        return (f"{', '.join(idle)} only act{'s' if one else ''} under harness.mode=reset; with "
                f"harness.mode={self.mode} {'it changes' if one else 'they change'} nothing")

    def tools(self, depth: int = 0) -> tuple[str, ...]:
        if self.resets:
            return ("search", "note_write", "handoff")
        return ("search", "delegate") if self.forks and depth < self.max_depth else ("search",)

    def system_text(self, depth: int = 0) -> str:
        tmpl = self.system_prompt if depth == 0 else self.subagent_system_prompt
        # str.replace, not format: prompts may contain JSON braces.
        return tmpl.replace("{tools}", "\n".join(TOOL_DOCS[t] for t in self.tools(depth)))

    def resume_text(self, question: str, summary: str) -> str:
        return self.resume_template.replace("{question}", question).replace("{summary}", summary)

    def role_of(self, index: int) -> int | None:
        """The role (0 or 1) of the ``index``-th reset session of a trajectory; None without roles."""
        return index % 2 if self.reset_roles else None

    def partner_plays(self, role: int | None) -> bool:
        """Whether a session of ``role`` is played by the partner (not the trained policy)."""
        return role == 1 and self.partner != "self"

    def reset_text(self, question: str, notes: Sequence[str]) -> str:
        """A reset session's user message: the question and the workspace's notes, one per line."""
        rendered = "\n".join(f"- {n}" for n in notes) if notes else "(empty)"
        return (self.reset_template.replace("{question}", question).replace("{k}", str(self.reset_k))
                .replace("{notes}", rendered))


    def replace(self, **overrides) -> "HarnessConfig":
        names = {f.name for f in fields(self)}
        bad = sorted(set(overrides) - names)
        if bad:
            raise ValueError(f"HarnessConfig has no field(s) {bad}")
        return HarnessConfig(**{**{n: getattr(self, n) for n in names}, **overrides})
