"""What session reconstruction works with: its settings (:class:`ReconstructionRules`), the drafts
of sessions being rebuilt (:class:`SessionDraft`), how calls are compared by text and by messages,
and rule 2 (:func:`dedup_retries`). The linking rules are in :mod:`mosaic.capture.linking`; the
rules are stated in the docstring of :mod:`mosaic.capture.reconstruct`.
"""

from __future__ import annotations

import json
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
        success_threshold: ``success = reward >= success_threshold`` (docs/algorithm.md §3).
        include_unrewarded: export rollouts no reward was posted for (reward 0,
            ``meta["reward_missing"]``); by default they are skipped.
        message_match: when no session's tip prefixes a call's prompt ids, continue the session
            whose last request + reply the call's messages repeat (rule 3b: the harness re-sent a
            turn differently from how it was sampled), and take that session as the parent of a
            compaction call extending no tip (rule 4); False opens a new session there instead (and leaves
            such a compaction to rule 5d).
        min_parent_score: the least share of a candidate's history (by characters) a compaction
            must reproduce to be attached to it by evidence (rule 5d); below it, recency decides
            and the compaction is flagged ``meta["parent_by"] = "recency"``.
        render_prefix: ``render_prefix(call, n)`` -> the token ids the upstream gives the first ``n`` of the
            call's chat messages (no generation prompt), or None. With it, a compaction call's history
            after its parent's last reply (the tool responses that came after it, before the instruction)
            is added to the parent's row, so the parent's end state holds its last tool response (docs/algorithm.md
            §4.4); without it that tail stays in the compaction's prompt only (``meta["history_tail"]``).
    """

    compaction_patterns: tuple[str, ...] = DEFAULT_COMPACTION_PATTERNS
    link_by_output: bool = True
    min_match_chars: int = 16
    dedup_retries: bool = True
    tie_break: Literal["oldest", "newest"] = "oldest"
    success_threshold: float = 1.0
    include_unrewarded: bool = False
    message_match: bool = True
    min_parent_score: float = 0.5
    render_prefix: Any = None

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
        if not 0.0 < self.min_parent_score <= 1.0:
            raise ValueError(f"min_parent_score: {self.min_parent_score} must be in (0, 1]")
        if not 0.0 <= self.success_threshold <= 1.0:
            raise ValueError(f"success_threshold: {self.success_threshold} must be in [0, 1]")


def _norm(text: str) -> str:
    return " ".join(text.split())


def is_prefix(prefix: Sequence[int], seq: Sequence[int]) -> bool:
    return len(prefix) <= len(seq) and list(seq[: len(prefix)]) == list(prefix)


def loose(text: str) -> str:
    """Text reduced to its lower-case words: what survives a harness re-sending a turn (dropped
    whitespace, markup that leaked into content and was stripped or escaped)."""
    return " ".join(re.findall(r"\w+", text.lower()))


def _args_text(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            return loose(args)
    try:
        return loose(json.dumps(args, sort_keys=True, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        return loose(str(args))


def tool_call_keys(tool_calls: Any) -> tuple[tuple[str, str], ...]:
    """``(name, arguments)`` of each tool call, arguments compared as parsed JSON, loosely."""
    out = []
    for tc in tool_calls if isinstance(tool_calls, list) else []:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if isinstance(fn, dict):
            out.append((str(fn.get("name") or ""), _args_text(fn.get("arguments"))))
    return tuple(out)


def tool_call_strings(tool_calls: Any) -> list[str]:
    """Every string argument value of a call's tool calls, loosely (a question handed to a subagent)."""
    out = []
    for tc in tool_calls if isinstance(tool_calls, list) else []:
        fn = tc.get("function") if isinstance(tc, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                continue
        if isinstance(args, dict):
            out += [loose(v) for v in args.values() if isinstance(v, str) and loose(v)]
    return out


def message_key(m: Any) -> tuple:
    """A chat message as a harness may re-send it: role, loose content, tool calls."""
    if not isinstance(m, dict):
        return ("?", loose(str(m)), ())
    return (str(m.get("role")), loose(content_text(m.get("content"))), tool_call_keys(m.get("tool_calls")))


def history_texts(c: CallRecord) -> list[str]:
    """The loose texts of a chat request's history (system messages left out): contents and tool
    call arguments, each once, non-empty."""
    out: list[str] = []
    for m in c.messages:
        if not isinstance(m, dict) or m.get("role") == "system":
            continue
        for t in [loose(content_text(m.get("content")))] + [a for _, a in tool_call_keys(m.get("tool_calls"))]:
            if t and t not in out:
                out.append(t)
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


@dataclass
class SessionDraft:
    """A session being rebuilt: its calls, its row, its kind and links (indices into the session list).

    The row is ``prompt`` + ``comp`` (with ``mask`` True on sampled tokens and their ``lps``). It holds,
    for every call, exactly the prompt that call was given (``row[:offsets[k]] == calls[k].prompt_ids``)
    followed by what the call sampled: a call that extends the tip adds the tokens the harness inserted
    (mask False) and its completion; a call that re-sends an earlier turn differently (rule 3b) rebuilds
    the row from where its prompt departs from it (:meth:`rebase`), and the sampled tokens past that
    point move to ``detached`` with the context they were sampled on.
    """

    idx: int
    calls: list[int]  # indices into the ordered call list
    tip: list[int]  # the last call's prompt + completion: what the next call's prompt must extend
    offsets: list[int]  # where each call's completion starts in the session's row
    prompt: list[int] = field(default_factory=list)
    comp: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # where each call's reply ends in the row
    detached: list[tuple[list[int], list[int], list[bool], list[float]]] = field(default_factory=list)
    kind: str = "main"
    parent: int | None = None
    edge: str | None = None
    parent_upto: int | None = None  # compaction: parent's context length when it started
    fork_before: int | None = None  # subagent: parent's context before the calling turn
    fork_after: int | None = None  # subagent: parent's context after the result was inserted
    successor: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def open(idx: int, i: int, c: CallRecord) -> "SessionDraft":
        """A session opened by call ``i``."""
        s = SessionDraft(idx=idx, calls=[], tip=[], offsets=[], prompt=list(c.prompt_ids))
        s._append(i, c)
        return s

    def end_of(self, k: int, calls: list[CallRecord] | None = None) -> int:
        """The row length after call ``k`` (a position in :attr:`calls`) and its reply."""
        return self.ends[k]

    def _append(self, i: int, c: CallRecord) -> None:
        self.calls.append(i)
        self.offsets.append(len(self.prompt) + len(self.comp))
        self.comp += c.completion_ids
        self.mask += [True] * len(c.completion_ids)
        ok = len(c.logprobs) == len(c.completion_ids)
        self.lps += [float(x) for x in c.logprobs] if ok else [0.0] * len(c.completion_ids)
        self.ends.append(len(self.prompt) + len(self.comp))
        self.tip = c.tip()

    def _insert(self, ids: Sequence[int]) -> None:
        self.comp += ids
        self.mask += [False] * len(ids)
        self.lps += [0.0] * len(ids)

    def extend(self, tail: Sequence[int]) -> None:
        """Inserted tokens after the last reply (a compaction's history past it): the row and tip grow."""
        self._insert(tail)
        self.tip = list(self.tip) + list(tail)

    def add(self, i: int, c: CallRecord, inserted: list[int], calls: list[CallRecord] | None = None) -> None:
        """Rule 3: call ``i`` extends the tip; ``inserted`` is what its prompt adds to it."""
        self._insert(inserted)
        self._append(i, c)

    def rebase(self, i: int, c: CallRecord, reply_end: int | None) -> int:
        """Rule 3b: call ``i``'s prompt re-renders the row differently from some point ``d`` on. The row
        keeps its first ``d`` tokens and follows the prompt from there; the sampled tokens at ``d`` and
        after move, with the context they were sampled on, to a detached stretch. ``reply_end``: where the
        re-rendered last reply ends in the prompt, if known. Returns the number of sampled tokens moved."""
        row = self.prompt + self.comp
        d = _common_prefix(row, c.prompt_ids)  # >= the last call's prompt: 3b checks it is a prefix
        r = d - len(self.prompt)
        moved = sum(self.mask[r:])
        if moved:
            self.detached.append((row[:d], self.comp[r:], self.mask[r:], self.lps[r:]))
        del self.comp[r:], self.mask[r:], self.lps[r:]
        last_end = self.ends[-1]
        self.offsets = [min(o, d) for o in self.offsets]
        self.ends = [min(e, d) for e in self.ends]
        # the re-rendered reply's end when found; else the prompt's end (its tool results included)
        self.ends[-1] = reply_end if reply_end is not None else (last_end if last_end <= d else len(c.prompt_ids))
        self._insert(c.prompt_ids[d:])
        self._append(i, c)
        return moved


class RolloutCalls:
    """The calls of one rollout with what reconstruction asks of them (texts, tool-call keys, prefixes)."""

    def __init__(self, calls: list[CallRecord], rules: ReconstructionRules):
        self.rules = rules
        self.calls = calls
        self._patterns = [re.compile(p) for p in rules.compaction_patterns]
        self._texts = [self._message_texts(c) for c in calls]
        self._loose: dict[int, str] = {}

    @staticmethod
    def _message_texts(c: CallRecord) -> list[str]:
        if c.endpoint != "chat":
            return [_norm(c.prompt or "")]
        return [_norm(content_text(m.get("content"))) for m in c.messages
                if isinstance(m, dict) and m.get("role") != "assistant"]

    def loose_request(self, j: int) -> str:
        """Call j's whole request as loose text (every message's content and tool call arguments)."""
        got = self._loose.get(j)
        if got is None:
            c = self.calls[j]
            if c.endpoint != "chat":
                got = loose(c.prompt or "")
            else:
                parts = []
                for m in c.messages:
                    if isinstance(m, dict):
                        parts.append(loose(content_text(m.get("content"))))
                        parts += [a for _, a in tool_call_keys(m.get("tool_calls"))]
                got = " ".join(p for p in parts if p)
            self._loose[j] = got
        return got

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
            last = content_text(c.messages[-1].get("content")) if c.messages and isinstance(c.messages[-1], dict) else ""
        else:
            last = (c.prompt or "")[-2000:]
        return any(p.search(last) for p in self._patterns)


TAIL_ADDED = "added to the parent"
TAIL_LEFT = "in the compaction's prompt only"
"""``meta["history_tail"]`` of a compaction (:func:`history_tail`)."""


def history_tail(rules: ReconstructionRules, c: CallRecord, p: SessionDraft, m: int, *, last: bool = True) -> str:
    """A compaction call's history past its parent's reply (its message ``m``; the tool responses a harness
    sends only with the instruction) ends the parent's row, as the parent's context held it (docs/algorithm.md
    §4.4): ``rules.render_prefix`` of ``c``'s messages up to the instruction, past the row, where the row is a
    prefix of that rendering and of ``c``'s prompt. Returns :data:`TAIL_ADDED`; :data:`TAIL_LEFT` where it
    cannot (no renderer, a re-rendered reply, a completions call, a reply that is not the parent's ``last``);
    "" when there is no tail."""
    n = len(c.messages) - 1  # (message n: the instruction)
    reply = c.messages[m] if c.endpoint == "chat" and 0 <= m < len(c.messages) else None
    if n == m + 1 and isinstance(reply, dict):
        return ""  # nothing between the reply and the instruction
    full = None
    if rules.render_prefix is not None and n > m + 1 and last and isinstance(reply, dict) and reply.get("role") == "assistant":
        try:
            full = rules.render_prefix(c, n)
        except Exception:  # noqa: BLE001 - a template that fails: the tail stays where it is, flagged
            full = None
    if full is None or not is_prefix(full, c.prompt_ids) or not is_prefix(p.tip, full):
        return TAIL_LEFT
    p.extend(full[len(p.tip):])
    return TAIL_ADDED


def _dedup(calls: list[CallRecord], ro: RolloutCalls) -> tuple[list[CallRecord], list[str]]:
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, c in enumerate(calls):
        groups.setdefault(tuple(c.prompt_ids), []).append(i)
    drop: set[int] = set()

    tips: dict[int, list[int]] = {}

    def builds_on(i: int, j: int) -> bool:  # call j goes on from call i's reply
        if i not in tips:
            tips[i] = calls[i].tip()
        return is_prefix(tips[i], calls[j].prompt_ids) or ro.appears_in(calls[i].text, j)

    for same in groups.values():
        # A call re-sent before anything went on from an earlier one is a retry; one sent after some call
        # built on an earlier one is a new start with the same prompt (a harness that compacts twice into
        # the same summary opens its next session with the prompt it opened the previous one with).
        runs = [[same[0]]]
        for i in same[1:]:
            if any(builds_on(m, j) for m in runs[-1] for j in range(m + 1, i) if j not in same):
                runs.append([i])
            else:
                runs[-1].append(i)
        for members in runs:
            if len(members) < 2:
                continue
            flags = {i: any(builds_on(i, j) for j in range(i + 1, len(calls)) if j not in members) for i in members}
            if any(flags.values()):
                drop.update(i for i in members if not flags[i])
            else:
                drop.update(members[:-1])
    kept = [c for i, c in enumerate(calls) if i not in drop]
    return kept, [calls[i].call_id for i in sorted(drop)]


def dedup_retries(calls: list[CallRecord], rules: ReconstructionRules) -> tuple[list[CallRecord], list[str]]:
    """Rule 2: drop retried calls (identical prompt ids, re-sent before any call went on from the earlier
    one) that nothing builds on; returns the kept calls and the dropped call ids."""
    return _dedup(calls, RolloutCalls(calls, rules))


