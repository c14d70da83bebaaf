"""Rebuild the session graph of a rollout from its interface call records.

Peers match each call only against the previous one, so interleaved subagents
fragment. Here every call is matched against **all** sessions of its rollout.

Rules (per rollout; settings in :class:`ReconstructionRules`):

1. **Order and filter.** Calls are ordered by arrival (``t_start``, then
   ``seq``). Calls that failed (an ``error``, an HTTP error, no token ids) are
   left out and counted in ``Trajectory.meta["errored_calls"]``, except a
   ``context_overflow`` call whose prompt ids were recorded: its prompt joins
   its session (no completion; listed in ``meta["overflow_calls"]``), so the
   tool result that overflowed the context is in the history that gets
   compacted.
2. **Retries.** Calls with identical prompt ids form a group, split where a
   call of the group comes after some other call went on from an earlier one
   of the group (a new start with the same prompt, e.g. after two compactions into the
   same summary). A call is *used* when a later call extends its tip (its
   prompt + completion ids are a prefix of the later prompt) or its returned
   text appears in a later call's messages. In a group with a used call, the
   unused ones are dropped; in a group with none used, only the last is kept
   (a retried call: keep the last).
3. **Sessions by longest prefix.** A call continues the session whose tip is
   the longest prefix of the call's prompt ids, searched over every session
   opened so far. The tokens between the tip and the new prompt (tool
   responses, template tokens) join the session with ``loss_mask`` False, the
   call's completion with ``loss_mask`` True. Equal longest tips are a tie:
   ``tie_break="oldest"`` takes the session opened first, ``"newest"`` the
   last; the other candidates are listed in ``meta["ambiguous_with"]``.

   b. **Re-sent turns** (``message_match``). When no tip prefixes the prompt,
   the call continues the session whose last request it repeats message by
   message, followed by that request's reply, compared loosely (words only:
   a harness that drops whitespace-only text next to tool calls, or strips
   markup that leaked into content, re-sends the same turn; a reply without
   tool calls may come back with tool calls the harness parsed out of its
   text; a reply cut at ``max_tokens`` counts). **Drift repair**: the later
   turns were sampled after the re-sent version, so the session's row is
   rebuilt to follow the call's prompt from the first token where it departs
   from the row; the sampled tokens from there on move, with the exact
   context they were sampled on, to a detached stretch of the session
   (``Session.detached``, trained as a row of its own with the session's
   advantage). Every trained token then sits on the context it was sampled
   from. The call is listed in ``meta["resent"]`` (with ``detached_tokens``);
   the trajectory counts ``meta["drift_repairs"]`` and
   ``meta["drift_detached_tokens"]``. Otherwise the call opens a new session;
   if some session's *prompt* is a prefix of it but not its tip, that session
   is named in ``meta["diverged_from"]``.
4. **Compaction by instruction.** A call whose last message matches one of
   ``compaction_patterns`` always opens a new ``compaction`` session, even if
   it extends a session's tip (the Mosaic harness appends the instruction to
   the history); the session it extends, if any, is its parent; else the
   session whose last request and reply it re-sends, the reply re-rendered
   (as 3b; ``meta["parent_by"] = "messages"``).
5. **Linking.** The first session is always the root ``main``. For every
   other session X, the text of its last call is searched in the
   non-assistant messages of later calls of other sessions, X's own
   compactions left out (whole message equality, or containment when at least
   ``min_match_chars`` long); the earliest such call is X's *hit*.

   a. A rule-4 compaction whose hit opens a new session Y: Y ``continues`` it.
   b. Compaction by output: a new session Y that restarts the agent (its first
      message equals the first message of an earlier session, e.g. the same
      system prompt) and whose first call is the hit of earlier sessions: the
      latest-started of them wrote the summary; it becomes a ``compaction`` and
      Y ``continues`` it (the others were results kept verbatim, see c).
   d. A compaction that extends no session's tip (whatever its system prompt)
      belongs to the session whose request history its prompt reproduces:
      among the sessions open when it started (not compactions, not compacted
      already, not finished with a reply), the one with the largest share of
      its last request's history texts (contents and tool call arguments,
      loosely, by characters) found in the compaction's request, if at least
      ``min_parent_score`` (``meta["parent_by"] = "history"``, the score in
      ``parent_score``, equal scores in ``parent_ambiguous``). Without such
      evidence, the agent session (the root or a compaction's successor) active
      most recently (``parent_by = "recency"``). Subagents compact too.
   c. Subagent: the hit of X's chain (X, or the last successor of X's
      compactions) is a later turn of a running session P (a tool result) →
      ``subagent`` forked by P (edge ``forks``). If the hit is the first prompt
      of a compaction or of a compaction's successor (the result was in the
      history that got summarised or kept), X is a subagent of the compacted
      session (``meta["result_seen_in"] = "compaction"``).
   e. Forward link: a session still without a parent whose first user message
      equals (loosely) a string argument of an earlier tool call of another
      session is a subagent forked by that call (the latest such call; others
      in ``meta["ambiguous_with"]``), whether or not its result was shown to a
      later model call (``meta["result_unseen"]`` when not).

   f. Reset: a session still without a parent that restarts the agent (its first message equals that
      of an agent session — the root's lineage, main or reset — which had finished before it started
      and has no successor) is that session's context reset: both are ``reset`` sessions, the new one
      ``continues`` the old (``meta["by"] = "reset"``); the notes it carries are in its prompt.

   A compaction's successor takes its parent's kind. Anything else stays
   ``main`` with no parent and ``meta["unlinked"]`` True (a compaction without
   successor gets ``meta["no_successor"]``).
6. **Final session.** From the root, follow ``continues`` edges through the
   root's compactions to their successors and through its resets: the last ``main`` (or ``reset``) of the root
   agent's lineage is the final session (subagents' compactions are not in
   it). Where the lineage branches, the branch whose last reply states the
   reward's answer wins, else the one that replied last (``meta["final_by"]``).
   Unlinked mains are never final. The trajectory's answer is the reward's
   when posted; else the final session's last reply; if that ended in tool
   calls whose subagents' results no later call saw (the harness returned a
   result directly), the last of those results (``meta["answer_from"]``).
7. **States (docs/algorithm.md §4.4).** main: its prompt → its full context. compaction:
   its parent's context when the compaction started → the successor's
   prompt. subagent: the parent's context before the turn that called it →
   the parent's context once the result was inserted (when the result was
   only seen in a compaction: → the parent's context when it was compacted;
   when never seen: → the parent's context after the calling turn). reset: its prompt → the next
   reset session's prompt (its own end when it is the last).
"""

from __future__ import annotations

import warnings
from typing import Iterable

from mosaic.capture.drops import RecordReport
from mosaic.capture.records import CallRecord, RewardRecord
from mosaic.capture.linking import chain_end, link_sessions
from mosaic.capture.sessions import (  # noqa: F401  (ReconstructionRules: re-exported, the public path)
    DEFAULT_COMPACTION_PATTERNS, ReconstructionRules, SessionDraft, dedup_retries,
)
from mosaic.trace.graph import Session, StateRef, Stretch, TraceError, Trajectory, validate


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
    good = [c for c in all_calls if _usable(c)]
    errored = [c.call_id for c in all_calls if not _usable(c)]
    rid = rollout_id if rollout_id is not None else (all_calls[0].rollout_id if all_calls else "")
    if not any(c.ok for c in good):
        return None
    dropped: list[str] = []
    if rules.dedup_retries:
        good, dropped = dedup_retries(good, rules)
    calls = good
    answer = reward.answer if reward and reward.answer is not None else None
    sessions, final = link_sessions(calls, rules, answer)
    out = [_trace_session(s, calls, sessions, s.idx == final) for s in sessions]
    hdr = calls[0].headers
    task_id = (reward.task_id if reward and reward.task_id else None) or hdr.get("x-mosaic-task") or rid
    group_id = (reward.group_id if reward and reward.group_id else None) or hdr.get("x-mosaic-group") or task_id
    r = float(reward.reward) if reward else 0.0
    final_call = calls[sessions[final].calls[-1]]
    meta = {
        "captured": True, "calls": len(all_calls), "errored_calls": errored, "retries_dropped": dropped,
        "overflow_calls": [c.call_id for c in calls if not c.ok],
        "retokenized": any(c.retokenized for c in calls), "reward_missing": reward is None,
        "unlinked_sessions": [s.idx for s in sessions if s.meta.get("unlinked")],
        "drift_repairs": sum(len(s.detached) for s in sessions),
        "drift_detached_tokens": sum(sum(x[2]) for s in sessions for x in s.detached),
    }
    if answer is None:
        answer, end_reason = _answer(sessions, final, calls, meta)
    else:
        meta["answer_from"] = "reward"
        end_reason = _end_reason(final_call)
    traj = Trajectory(
        id=rid, task_id=task_id, group_id=group_id, sessions=out, reward=r,
        success=bool(reward) and r >= rules.success_threshold,
        answer=answer, ground_truth=reward.ground_truth if reward else None, end_reason=end_reason, meta=meta,
    )
    return validate(traj)


def _usable(c: CallRecord) -> bool:
    """A call that takes part in reconstruction: a successful one, or an overflow with its prompt."""
    return (c.ok and c.error is None) or (c.context_overflow and bool(c.prompt_ids))


def _end_reason(c: CallRecord) -> str:
    if c.context_overflow and not c.ok:
        return "context_overflow"
    return "answer" if c.finish_reason == "stop" else (c.finish_reason or "")


def _answer(sessions: list[SessionDraft], final: int, calls: list[CallRecord], meta: dict) -> tuple:
    """Without a posted answer: the final session's last reply; if that call handed its work to
    subagents whose results no later call saw, the result of the last of them to finish (rule 6)."""
    f = sessions[final]
    last = calls[f.calls[-1]]
    if last.tool_calls and last.ok:
        calling = f.offsets[-1]
        subs = [s for s in sessions if s.parent == final and s.edge == "forks" and s.fork_before == calling
                and s.meta.get("result_unseen")]
        ends = [chain_end(sessions, s) for s in subs]
        ends = [e for e in ends if calls[e.calls[-1]].finish_reason == "stop" and calls[e.calls[-1]].text]
        if ends:
            e = max(ends, key=lambda e: calls[e.calls[-1]].t_end)
            meta["answer_from"] = f"subagent {e.idx}"
            return calls[e.calls[-1]].text, "subagent_result"
    meta["answer_from"] = "final_session"
    return last.text or None, _end_reason(last)


def _session_flags(s: SessionDraft, calls: list[CallRecord]) -> dict:
    """Flags for a session's meta: a call without log-probs (its tokens carry 0.0), a retokenized call."""
    flags = {}
    if any(len(calls[ci].logprobs) != len(calls[ci].completion_ids) for ci in s.calls):
        flags["logprobs_missing"] = True
    if any(calls[ci].retokenized for ci in s.calls):
        flags["retokenized"] = True
    return flags


def _states(s: SessionDraft, calls: list[CallRecord], sessions: list[SessionDraft]) -> tuple:
    """``(state_before, state_after)`` of a session (docs/algorithm.md §4.4)."""
    if s.kind == "compaction":
        before = StateRef(session=s.parent, upto=s.parent_upto) if s.parent is not None else None
        after = (StateRef(session=s.successor, upto=len(calls[sessions[s.successor].calls[0]].prompt_ids))
                 if s.successor is not None else None)
    elif s.kind == "reset":  # its prompt (with the notes it got) → the next reset session's (with its notes)
        nxt = next((x for x in sessions if x.parent == s.idx and x.edge == "continues" and x.kind == "reset"), None)
        before = StateRef(session=s.idx, upto=len(calls[s.calls[0]].prompt_ids))
        after = (StateRef(session=nxt.idx, upto=len(calls[nxt.calls[0]].prompt_ids)) if nxt is not None
                 else StateRef(session=s.idx, upto=None))
    elif s.kind == "subagent" and s.fork_before is not None:
        before = StateRef(session=s.parent, upto=s.fork_before)
        after = StateRef(session=s.parent, upto=s.fork_after)
    else:
        before = StateRef(session=s.idx, upto=len(calls[s.calls[0]].prompt_ids))
        after = StateRef(session=s.idx, upto=None)
    return before, after


def _trace_session(s: SessionDraft, calls: list[CallRecord], sessions: list[SessionDraft], is_final: bool) -> Session:
    first, last = calls[s.calls[0]], calls[s.calls[-1]]
    meta = dict(s.meta)
    meta["call_ids"] = [calls[ci].call_id for ci in s.calls]
    meta["t_start"], meta["t_end"] = first.t_start, last.t_end
    meta.update(_session_flags(s, calls))
    before, after = _states(s, calls, sessions)
    if s.kind == "compaction":
        end_reason = "compaction"
    else:
        end_reason = "context_overflow" if not last.ok else (last.finish_reason or "")
    return Session(
        id=s.idx, kind=s.kind, prompt_ids=list(s.prompt), completion_ids=list(s.comp), loss_mask=list(s.mask),
        logprobs=list(s.lps), detached=[Stretch(*map(list, x)) for x in s.detached], parent=s.parent, edge=s.edge, end_reason=end_reason, is_final=is_final,
        state_before=before, state_after=after, num_turns=sum(1 for ci in s.calls if calls[ci].ok), meta=meta,
    )


def reconstruct(
    calls: Iterable[CallRecord],
    rewards: dict[str, RewardRecord] | None = None,
    rules: ReconstructionRules | None = None,
    report: RecordReport | None = None,
) -> list[Trajectory]:
    """Every rollout in ``calls`` → trajectories (ordered by first call).

    Rollouts without a reward are skipped (with a warning) unless
    ``rules.include_unrewarded``; rollouts without a usable call, or whose calls cannot be rebuilt
    (the error is named), are skipped with a warning. ``report``: each skipped rollout is also added
    to it (``no_reward``, ``unbuildable``), the drop report every reader of records shares.
    """
    rules = rules or ReconstructionRules()
    rewards = rewards or {}
    report = report if report is not None else RecordReport()
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
            report.drop(rid, "no_reward", "no reward posted")
            continue
        try:
            t = reconstruct_rollout(by[rid], rw, rules, rollout_id=rid)
            why = "no usable call"
        except (TraceError, ValueError, KeyError, IndexError) as exc:
            t, why = None, f"{type(exc).__name__}: {exc}"[:500]
        if t is None:
            skipped_empty.append(rid)
            report.drop(rid, "unbuildable", why)
            continue
        out.append(t)
    if skipped_reward:
        warnings.warn(f"skipped {len(skipped_reward)} rollout(s) with no reward posted: {skipped_reward[:5]}"
                      " (post one to /rollouts/{id}/reward, or include_unrewarded=True)", stacklevel=2)
    if skipped_empty:
        warnings.warn(f"skipped {len(skipped_empty)} rollout(s) with no usable call: {skipped_empty[:5]}",
                      stacklevel=2)
    return out
