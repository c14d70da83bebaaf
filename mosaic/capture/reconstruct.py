"""Rebuild the session graph of a rollout from its interface call records.

Peers match each call only against the previous one, so interleaved subagents
fragment. Here every call is matched against **all** sessions of its rollout.

Rules (per rollout; settings in :class:`ReconstructionRules`):

1. **Order and filter.** Calls are ordered by arrival (``t_start``, then
   ``seq``). Calls that failed (an ``error``, an HTTP error, no token ids) are
   left out and counted in ``Trajectory.meta["errored_calls"]``.
2. **Retries.** Calls with identical prompt ids form a group. A call is *used*
   when a later call extends its tip (its prompt + completion ids are a prefix
   of the later prompt) or its returned text appears in a later call's
   messages. In a group with a used call, the unused ones are dropped; in a
   group with none used, only the last is kept (a retried call: keep the last).
3. **Sessions by longest prefix.** A call continues the session whose tip is
   the longest prefix of the call's prompt ids, searched over every session
   opened so far. The tokens between the tip and the new prompt (tool
   responses, template tokens) join the session with ``loss_mask`` False, the
   call's completion with ``loss_mask`` True. Equal longest tips are a tie:
   ``tie_break="oldest"`` takes the session opened first, ``"newest"`` the
   last; the other candidates are listed in ``meta["ambiguous_with"]``. A call
   no tip prefixes opens a new session; if some session's *prompt* is a prefix
   of it but not its tip (the harness re-serialised the last reply: drift),
   that session is named in ``meta["diverged_from"]``.
4. **Compaction by instruction.** A call whose last message matches one of
   ``compaction_patterns`` always opens a new ``compaction`` session, even if
   it extends a session's tip (the Mosaic harness appends the instruction to
   the history); the session it extends, if any, is its parent.
5. **Linking by returned text.** The first session is always the root
   ``main``. For every other session X, the text of its last call is searched
   in the non-assistant messages of later calls of other sessions (whole
   message equality, or containment when at least ``min_match_chars`` long);
   the earliest such call is X's *hit*.
   a. A rule-4 compaction whose hit opens a new session Y: Y ``continues`` it.
   b. Compaction by output: a new session Y that restarts the agent (its first
      message equals the first message of an earlier session, e.g. the same
      system prompt) and whose first call is the hit of earlier sessions: the
      latest-started of them wrote the summary; it becomes a ``compaction`` and
      Y ``continues`` it (the others were results kept verbatim, see c).
   c. Subagent: X's hit is a later turn of a running session P (a tool
      result) → ``subagent`` forked by P (edge ``forks``). If the hit is the
      first prompt of a compaction or of a compaction's successor (the result
      was in the history that got summarised or kept), X is a subagent of the
      compacted session (``meta["result_seen_in"] = "compaction"``).
   d. A compaction that extends no session's tip gets as parent the agent
      session (the root or a compaction's successor) active most recently
      before it started; a compaction's successor takes its parent's kind.
   Anything else stays ``main`` with no parent and ``meta["unlinked"]`` True
   (a compaction without successor gets ``meta["no_successor"]``).
6. **Final session.** From the root, follow ``continues`` edges through
   compactions to their successors (the latest when several); the last
   ``main`` reached is the final session. Unlinked mains are never final.
7. **States (SPEC §4.4).** main: its prompt → its full context. compaction:
   its parent's context when the compaction started → the successor's
   prompt. subagent: the parent's context before the turn that called it →
   the parent's context once the result was inserted (when the result was
   only seen in a compaction: → the parent's context when it was compacted).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Sequence

from mosaic.capture.records import CallRecord, RewardRecord, content_text
from mosaic.trace.graph import Session, StateRef, Trajectory, validate

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
class _Sess:
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


def reconstruct_rollout(
    calls: Iterable[CallRecord],
    reward: RewardRecord | None = None,
    rules: ReconstructionRules | None = None,
    *,
    rollout_id: str | None = None,
) -> Trajectory | None:
    """One rollout's calls (any order) → a validated :class:`Trajectory`; None if no usable call."""
    rules = rules or ReconstructionRules()
    all_calls = sorted(calls, key=lambda c: (c.t_start, c.seq))
    good = [c for c in all_calls if c.ok and c.error is None]
    errored = [c.call_id for c in all_calls if not (c.ok and c.error is None)]
    rid = rollout_id if rollout_id is not None else (all_calls[0].rollout_id if all_calls else "")
    if not good:
        return None
    dropped: list[str] = []
    if rules.dedup_retries:
        good, dropped = _dedup(good, _Rollout(good, rules))
    ro = _Rollout(good, rules)
    calls = good

    # -- rule 3/4: sessions by longest prefix ------------------------------------------------------
    sessions: list[_Sess] = []
    call_sess: list[int] = []
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
        new = _Sess(idx=len(sessions), calls=[i], tip=c.tip(), offsets=[len(c.prompt_ids)])
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

    # The first session is the root: the agent working on the task (rule 5's last line).
    sessions[0].kind, sessions[0].parent, sessions[0].edge = "main", None, None
    sessions[0].meta.pop("by", None)

    # -- rule 5: link new sessions by where their returned text reappears ----------------------------
    # hit[x]: the earliest later call of another session whose non-assistant messages hold x's text.
    hit: dict[int, int] = {}
    if rules.link_by_output:
        for x in sessions[1:]:
            last_i = x.calls[-1]
            text = calls[last_i].text
            for j in range(last_i + 1, len(calls)):
                if call_sess[j] != x.idx and ro.appears_in(text, j):
                    hit[x.idx] = j
                    break

    def opens(j: int) -> bool:
        return sessions[call_sess[j]].calls[0] == j

    def first_message(sess: _Sess) -> Any:
        c = calls[sess.calls[0]]
        return c.messages[0] if c.endpoint == "chat" and c.messages else None

    # 5a. Successors of instruction compactions: the new session their summary opens.
    for x in sessions:
        if x.kind == "compaction" and x.idx in hit and opens(hit[x.idx]):
            y = sessions[call_sess[hit[x.idx]]]
            if y.idx > x.idx and y.parent is None and y.kind != "compaction":
                x.successor, y.parent, y.edge = y.idx, x.idx, "continues"
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
    successor_of = {x.successor: x.idx for x in sessions if x.successor is not None}
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
    for x in sessions:
        if x.successor is not None:
            p = x.parent
            sessions[x.successor].kind = sessions[p].kind if p is not None else "main"

    # -- rule 6: the final session ------------------------------------------------------------------
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
    final = cur if sessions[cur].kind == "main" else 0

    # -- build the trace sessions -----------------------------------------------------------------
    out: list[Session] = []
    for s in sessions:
        first = calls[s.calls[0]]
        comp, mask, lps = [], [], []
        prev_tip = len(first.prompt_ids)
        logprobs_missing = False
        retok = False
        for k, ci in enumerate(s.calls):
            c = calls[ci]
            if k > 0:
                inserted = c.prompt_ids[prev_tip:]
                comp += inserted
                mask += [False] * len(inserted)
                lps += [0.0] * len(inserted)
            comp += c.completion_ids
            mask += [True] * len(c.completion_ids)
            if len(c.logprobs) == len(c.completion_ids):
                lps += [float(x) for x in c.logprobs]
            else:
                logprobs_missing = True
                lps += [0.0] * len(c.completion_ids)
            retok = retok or c.retokenized
            prev_tip = len(c.prompt_ids) + len(c.completion_ids)
        meta = dict(s.meta)
        meta["call_ids"] = [calls[ci].call_id for ci in s.calls]
        meta["t_start"], meta["t_end"] = first.t_start, calls[s.calls[-1]].t_end
        if logprobs_missing:
            meta["logprobs_missing"] = True
        if retok:
            meta["retokenized"] = True
        n_prompt = len(first.prompt_ids)
        if s.kind == "compaction":
            before = StateRef(session=s.parent, upto=s.parent_upto) if s.parent is not None else None
            after = (StateRef(session=s.successor, upto=len(calls[sessions[s.successor].calls[0]].prompt_ids))
                     if s.successor is not None else None)
        elif s.kind == "subagent" and s.fork_before is not None:
            before = StateRef(session=s.parent, upto=s.fork_before)
            after = StateRef(session=s.parent, upto=s.fork_after)
        else:
            before = StateRef(session=s.idx, upto=n_prompt)
            after = StateRef(session=s.idx, upto=None)
        last = calls[s.calls[-1]]
        end_reason = "compaction" if s.kind == "compaction" else (last.finish_reason or "")
        out.append(Session(
            id=s.idx, kind=s.kind, prompt_ids=list(first.prompt_ids), completion_ids=comp, loss_mask=mask,
            logprobs=lps, parent=s.parent, edge=s.edge, end_reason=end_reason, is_final=s.idx == final,
            state_before=before, state_after=after, num_turns=len(s.calls), meta=meta,
        ))

    hdr = calls[0].headers
    task_id = (reward.task_id if reward and reward.task_id else None) or hdr.get("x-mosaic-task") or rid
    group_id = (reward.group_id if reward and reward.group_id else None) or hdr.get("x-mosaic-group") or task_id
    r = float(reward.reward) if reward else 0.0
    final_call = calls[sessions[final].calls[-1]]
    traj = Trajectory(
        id=rid, task_id=task_id, group_id=group_id, sessions=out, reward=r,
        success=bool(reward) and r >= rules.success_threshold,
        answer=(reward.answer if reward and reward.answer is not None else final_call.text or None),
        ground_truth=reward.ground_truth if reward else None,
        end_reason="answer" if final_call.finish_reason == "stop" else (final_call.finish_reason or ""),
        meta={
            "captured": True, "calls": len(all_calls), "errored_calls": errored, "retries_dropped": dropped,
            "retokenized": any(c.retokenized for c in calls), "reward_missing": reward is None,
            "unlinked_sessions": [s.idx for s in sessions if s.meta.get("unlinked")],
        },
    )
    return validate(traj)


def reconstruct(
    calls: Iterable[CallRecord],
    rewards: dict[str, RewardRecord] | None = None,
    rules: ReconstructionRules | None = None,
) -> list[Trajectory]:
    """Every rollout in ``calls`` → trajectories (ordered by first call).

    Rollouts without a reward are skipped (with a warning) unless
    ``rules.include_unrewarded``; rollouts without a usable call are skipped with a warning.
    """
    rules = rules or ReconstructionRules()
    rewards = rewards or {}
    by: dict[str, list[CallRecord]] = {}
    for c in calls:
        by.setdefault(c.rollout_id, []).append(c)
    order = sorted(by, key=lambda r: min((c.t_start, c.seq) for c in by[r]))
    out: list[Trajectory] = []
    skipped_reward, skipped_empty = [], []
    for rid in order:
        rw = rewards.get(rid)
        if rw is None and not rules.include_unrewarded:
            skipped_reward.append(rid)
            continue
        t = reconstruct_rollout(by[rid], rw, rules, rollout_id=rid)
        if t is None:
            skipped_empty.append(rid)
            continue
        out.append(t)
    if skipped_reward:
        warnings.warn(f"skipped {len(skipped_reward)} rollout(s) with no reward posted: {skipped_reward[:5]}"
                      " (post one to /rollouts/{id}/reward, or include_unrewarded=True)", stacklevel=2)
    if skipped_empty:
        warnings.warn(f"skipped {len(skipped_empty)} rollout(s) with no usable call: {skipped_empty[:5]}",
                      stacklevel=2)
    return out
