"""One rollout's session graph from its calls: the settings (:class:`ReconstructionRules`) and the
rules themselves (:func:`dedup_retries`, :func:`link_sessions`), as stated in the docstring of
:mod:`mosaic.capture.reconstruct`, which turns the result into a :class:`~mosaic.trace.Trajectory`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from mosaic.capture.records import CallRecord, content_text

DEFAULT_COMPACTION_PATTERNS: tuple[str, ...] = (
    r"(?i)messages to summari[sz]e",
    r"(?i)\bsummari[sz]e (the|this|our) (conversation|history|session)",
    r"(?i)\bcompact (the|this) (conversation|history|context)",
)


@dataclass(frozen=True)
class ReconstructionRules:
    """Settings of session reconstruction (see the module docstring for the rules).

    Attributes:
        compaction_patterns: regexes; a call whose last message matches any opens a
            compaction session (rule 4). Empty disables rule 4.
        link_by_output: classify new sessions by where their returned text reappears (rule 5).
        min_match_chars: shortest returned text that may match by containment; shorter
            texts must equal a whole message's content.
        dedup_retries: apply rule 2.
        tie_break: which of several sessions with equal longest tips a call continues.
        success_threshold: ``success = reward >= success_threshold`` (SPEC §3).
        include_unrewarded: export rollouts no reward was posted for (reward 0,
            ``meta["reward_missing"]``); by default they are skipped.
    """

    compaction_patterns: tuple[str, ...] = DEFAULT_COMPACTION_PATTERNS
    link_by_output: bool = True
    min_match_chars: int = 16
    dedup_retries: bool = True
    tie_break: Literal["oldest", "newest"] = "oldest"
    success_threshold: float = 1.0
    include_unrewarded: bool = False

    def __post_init__(self) -> None:
        for p in self.compaction_patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"compaction_patterns: {p!r} is not a valid regex ({exc})") from None
        if self.min_match_chars < 1:
            raise ValueError(f"min_match_chars: {self.min_match_chars} must be at least 1")
        if self.tie_break not in ("oldest", "newest"):
            raise ValueError(f"tie_break: {self.tie_break!r} must be 'oldest' or 'newest'")
        if not 0.0 <= self.success_threshold <= 1.0:
            raise ValueError(f"success_threshold: {self.success_threshold} must be in [0, 1]")


def _norm(text: str) -> str:
    return " ".join(text.split())


def _is_prefix(prefix: Sequence[int], seq: Sequence[int]) -> bool:
    return len(prefix) <= len(seq) and list(seq[: len(prefix)]) == list(prefix)


@dataclass
class SessionDraft:
    """A session being rebuilt: its calls, tip, kind and links (indices into the session list)."""

    idx: int
    calls: list[int]  # indices into the ordered call list
    tip: list[int]
    offsets: list[int]  # prompt length of each call == its position in the session's tokens
    kind: str = "main"
    parent: int | None = None
    edge: str | None = None
    parent_upto: int | None = None  # compaction: parent's context length when it started
    fork_before: int | None = None  # subagent: parent's context before the calling turn
    fork_after: int | None = None  # subagent: parent's context after the result was inserted
    successor: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class _Rollout:
    def __init__(self, calls: list[CallRecord], rules: ReconstructionRules):
        self.rules = rules
        self.calls = calls
        self._patterns = [re.compile(p) for p in rules.compaction_patterns]
        self._texts = [self._message_texts(c) for c in calls]

    @staticmethod
    def _message_texts(c: CallRecord) -> list[str]:
        if c.endpoint != "chat":
            return [_norm(c.prompt or "")]
        return [_norm(content_text(m.get("content"))) for m in c.messages if m.get("role") != "assistant"]

    def appears_in(self, text: str, j: int) -> bool:
        t = _norm(text)
        if not t:
            return False
        for m in self._texts[j]:
            if m == t or (len(t) >= self.rules.min_match_chars and t in m):
                return True
        return False

    def is_compaction_call(self, c: CallRecord) -> bool:
        if not self._patterns:
            return False
        if c.endpoint == "chat":
            last = content_text(c.messages[-1].get("content")) if c.messages else ""
        else:
            last = (c.prompt or "")[-2000:]
        return any(p.search(last) for p in self._patterns)


def _dedup(calls: list[CallRecord], ro: _Rollout) -> tuple[list[CallRecord], list[str]]:
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, c in enumerate(calls):
        groups.setdefault(tuple(c.prompt_ids), []).append(i)
    drop: set[int] = set()
    for members in groups.values():
        if len(members) < 2:
            continue

        def used(i: int) -> bool:
            tip = calls[i].tip()
            for j in range(i + 1, len(calls)):
                if j in members:
                    continue
                if _is_prefix(tip, calls[j].prompt_ids) or ro.appears_in(calls[i].text, j):
                    return True
            return False

        flags = {i: used(i) for i in members}
        if any(flags.values()):
            drop.update(i for i in members if not flags[i])
        else:
            drop.update(members[:-1])
    kept = [c for i, c in enumerate(calls) if i not in drop]
    return kept, [calls[i].call_id for i in sorted(drop)]


def dedup_retries(calls: list[CallRecord], rules: ReconstructionRules) -> tuple[list[CallRecord], list[str]]:
    """Rule 2: drop retried calls (identical prompt ids) that nothing builds on; returns the kept
    calls and the dropped call ids."""
    return _dedup(calls, _Rollout(calls, rules))


def link_sessions(calls: list[CallRecord], rules: ReconstructionRules) -> tuple[list[SessionDraft], int]:
    """Rules 1 and 3–6 over a rollout's ordered, successful calls: the sessions and the final one's index."""
    linker = _Linker(calls, rules)
    final = linker.run()
    return linker.sessions, final


class _Linker:
    """The session graph of one rollout, built rule by rule (see the reconstruct module docstring)."""

    def __init__(self, calls: list[CallRecord], rules: ReconstructionRules):
        self.calls, self.rules = calls, rules
        self.ro = _Rollout(calls, rules)
        self.sessions: list[SessionDraft] = []
        self.call_sess: list[int] = []  # the session of each call

    def run(self) -> int:
        self._assign()
        sessions = self.sessions
        # The first session is the root: the agent working on the task (rule 5's last line).
        sessions[0].kind, sessions[0].parent, sessions[0].edge = "main", None, None
        sessions[0].meta.pop("by", None)
        hit = self._output_hits()
        self._link_summaries(hit)
        self._find_output_compactions(hit)
        successor_of = {x.successor: x.idx for x in sessions if x.successor is not None}
        via = self._link_subagents(hit, successor_of)
        self._parent_compactions(hit, successor_of)
        self._resolve_via(via)
        for x in sessions:
            if x.successor is not None:
                p = x.parent
                sessions[x.successor].kind = sessions[p].kind if p is not None else "main"
        return self._final()

    def _opens(self, j: int) -> bool:
        return self.sessions[self.call_sess[j]].calls[0] == j

    def _first_message(self, sess: SessionDraft) -> Any:
        c = self.calls[sess.calls[0]]
        return c.messages[0] if c.endpoint == "chat" and c.messages else None

    def _assign(self) -> None:
        """Rules 3 and 4: each call continues the session whose tip is its longest prefix, or opens one."""
        rules, calls, ro, sessions, call_sess = self.rules, self.calls, self.ro, self.sessions, self.call_sess
        for i, c in enumerate(calls):
            best: list[int] = []
            best_len = -1
            for s in sessions:
                if len(s.tip) >= best_len and _is_prefix(s.tip, c.prompt_ids):
                    if len(s.tip) > best_len:
                        best, best_len = [s.idx], len(s.tip)
                    else:
                        best.append(s.idx)
            compaction = ro.is_compaction_call(c)
            if best and not compaction:
                pick = best[0] if rules.tie_break == "oldest" else best[-1]
                s = sessions[pick]
                if len(best) > 1:
                    s.meta.setdefault("ambiguous_with", []).append(
                        {"call_id": c.call_id, "sessions": [b for b in best if b != pick]})
                s.calls.append(i)
                s.offsets.append(len(c.prompt_ids))
                s.tip = c.tip()
                call_sess.append(pick)
                continue
            new = SessionDraft(idx=len(sessions), calls=[i], tip=c.tip(), offsets=[len(c.prompt_ids)])
            if compaction:
                new.kind = "compaction"
                new.meta["by"] = "instruction"
                if best:
                    new.parent = best[0] if rules.tie_break == "oldest" else best[-1]
                    new.edge = "continues"
                    new.parent_upto = best_len
            else:
                for s in sessions:
                    first = calls[s.calls[0]]
                    if _is_prefix(first.prompt_ids, c.prompt_ids) and len(first.prompt_ids) < len(c.prompt_ids):
                        new.meta["diverged_from"] = s.idx
            sessions.append(new)
            call_sess.append(new.idx)

    def _output_hits(self) -> dict[int, int]:
        """Rule 5: ``hit[x]``, the earliest later call of another session whose non-assistant messages
        hold session x's returned text."""
        rules, calls, ro, sessions, call_sess = self.rules, self.calls, self.ro, self.sessions, self.call_sess
        hit: dict[int, int] = {}
        if rules.link_by_output:
            for x in sessions[1:]:
                last_i = x.calls[-1]
                text = calls[last_i].text
                for j in range(last_i + 1, len(calls)):
                    if call_sess[j] != x.idx and ro.appears_in(text, j):
                        hit[x.idx] = j
                        break
        return hit

    def _link_summaries(self, hit: dict[int, int]) -> None:
        """5a: an instruction compaction's successor is the new session its summary opens."""
        sessions, call_sess, opens = self.sessions, self.call_sess, self._opens
        for x in sessions:
            if x.kind == "compaction" and x.idx in hit and opens(hit[x.idx]):
                y = sessions[call_sess[hit[x.idx]]]
                if y.idx > x.idx and y.parent is None and y.kind != "compaction":
                    x.successor, y.parent, y.edge = y.idx, x.idx, "continues"

    def _find_output_compactions(self, hit: dict[int, int]) -> None:
        """5b: compactions found by output (the restarted agent holds their summary)."""
        sessions, first_message = self.sessions, self._first_message
        # 5b. Compactions found by output: a new session that restarts the agent (its first message is
        #     the first message of an earlier session, e.g. the same system prompt) and holds the text of
        #     earlier sessions in its first prompt; the latest-started of them wrote the summary.
        for y in sessions[1:]:
            if y.parent is not None or y.kind == "compaction":
                continue
            fm = first_message(y)
            if fm is None or not any(first_message(s) == fm for s in sessions[: y.idx]):
                continue
            cands = [x for x in sessions[1: y.idx] if x.kind != "compaction" and x.parent is None
                     and x.successor is None and hit.get(x.idx) == y.calls[0]]
            if cands:
                x = max(cands, key=lambda s: s.calls[0])
                x.kind, x.successor = "compaction", y.idx
                x.meta.setdefault("by", "output")
                y.parent, y.edge = x.idx, "continues"

    def _link_subagents(self, hit: dict[int, int], successor_of: dict[int, int]) -> dict[int, int]:
        """5c: subagents, by where their result reappears; returns those first seen in a compaction's
        history (session -> compaction), whose parent is resolved after 5d."""
        sessions, call_sess, opens = self.sessions, self.call_sess, self._opens
        # 5c. Subagents: the text reappears in a later turn of a running session (a tool result), or in
        #     the first prompt of a compaction or of its successor (the result was in the history that got
        #     summarised or kept), then the parent is the compacted session (resolved after 5d).
        via: dict[int, int] = {}
        for x in sessions[1:]:
            if x.kind == "compaction" or x.parent is not None:
                continue
            j = hit.get(x.idx)
            if j is None:
                x.meta["unlinked"] = True
                continue
            y = sessions[call_sess[j]]
            if not opens(j):
                x.kind, x.parent, x.edge = "subagent", y.idx, "forks"
                pos = y.calls.index(j)
                x.fork_before, x.fork_after = y.offsets[pos - 1], y.offsets[pos]
            elif y.kind == "compaction":
                x.kind, via[x.idx] = "subagent", y.idx
            elif y.idx in successor_of:
                x.kind, via[x.idx] = "subagent", successor_of[y.idx]
            else:
                x.meta["unlinked"] = True
        return via

    def _parent_compactions(self, hit: dict[int, int], successor_of: dict[int, int]) -> None:
        """5d: compactions without a parent get the agent session active most recently before them."""
        sessions, calls = self.sessions, self.calls
        # 5d. Compactions with no parent yet: the agent session (the root or a compaction's successor)
        #     active most recently before the compaction started.
        agents = {0} | set(successor_of)
        for x in sessions:
            if x.kind == "compaction":
                if x.idx not in hit and x.successor is None:
                    x.meta["no_successor"] = True
                if x.parent is not None:
                    continue
                first = x.calls[0]
                cands = [(max(k for k in s.calls if k < first), s.idx) for s in sessions
                         if s.idx in agents and s.idx != x.idx and any(k < first for k in s.calls)]
                if cands:
                    last_before, p = max(cands)
                    x.parent, x.edge = p, "continues"
                    x.parent_upto = len(calls[last_before].tip())

    def _resolve_via(self, via: dict[int, int]) -> None:
        """5c, continued: a subagent seen only in a compaction's history forks from the compacted session."""
        sessions, calls = self.sessions, self.calls
        for xi, ci in via.items():
            x, c = sessions[xi], sessions[ci]
            if c.parent is None:
                x.kind = "main"
                x.meta["unlinked"] = True
                continue
            x.parent, x.edge = c.parent, "forks"
            p = sessions[c.parent]
            # The parent's last turn before the fork; its result was never seen in a parent prompt.
            before = [k for k in p.calls if k < x.calls[0]]
            x.fork_before = len(calls[before[-1]].prompt_ids) if before else len(calls[p.calls[0]].prompt_ids)
            x.fork_after = c.parent_upto
            x.meta["result_seen_in"] = "compaction"

    def _final(self) -> int:
        """Rule 6: the final session, the last main reached from the root through compactions."""
        sessions = self.sessions
        cur = 0
        seen = {0}
        while True:
            nxt = [s for s in sessions if s.parent == cur and s.edge == "continues" and s.kind == "compaction"
                   and s.successor is not None]
            if not nxt:
                break
            succ = max(nxt, key=lambda s: s.calls[0]).successor
            if succ in seen:
                break
            seen.add(succ)
            cur = succ
        return cur if sessions[cur].kind == "main" else 0
