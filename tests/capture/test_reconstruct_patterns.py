"""Session graphs of the patterns a second real harness produced (issue 12), rebuilt exactly:
a subagent that compacts its own history, a subagent whose result is returned directly, turns
re-sent differently from how they were sampled, and a context overflow before a compaction."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mosaic.capture.reconstruct import ReconstructionRules, reconstruct_rollout
from mosaic.capture.records import RewardRecord
from mosaic.capture.scripted import Renderer, build_tokenizer
from mosaic.trace import StateRef

from . import _patterns as P
from ._fidelity import assert_trained_on_sampled_contexts


@functools.lru_cache(maxsize=1)
def _tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def rnd():
    return Renderer(_tok())


def _shape(t):
    return [(s.kind, s.parent, s.edge, s.is_final) for s in t.sessions]


def _first_user(t, s, recs):
    rec = next(r for r in recs if r.call_id == s.meta["call_ids"][0])
    return next(m["content"] for m in rec.messages if m["role"] == "user")


def _exact(t, recs):
    """Every call's completion is trained once, on the context it was sampled from (in its session's
    row, or in a detached stretch after a re-sent turn); each session starts with its first call's prompt
    and its row ends with its last call's completion."""
    by_id = {r.call_id: r for r in recs}
    for s in t.sessions:
        toks = s.tokens()
        calls = [by_id[c] for c in s.meta["call_ids"]]
        assert s.prompt_ids == calls[0].prompt_ids
        assert s.num_trainable + sum(sum(x.loss_mask) for x in s.detached) == sum(len(c.completion_ids) for c in calls)
        assert toks[-len(calls[-1].completion_ids) or len(toks):] == calls[-1].completion_ids
        assert toks[: len(calls[-1].prompt_ids)] == calls[-1].prompt_ids  # the row follows the last prompt
    assert_trained_on_sampled_contexts(t, recs)


def test_subagent_that_compacts_its_own_history(rnd):
    recs, answer = P.run(P.subagent_compacts, rnd, "p1")
    t = reconstruct_rollout(recs, RewardRecord("p1", 1.0, ground_truth="x"))
    assert _shape(t) == [("main", None, None, True), ("subagent", 0, "forks", False),
                         ("subagent", 0, "forks", False), ("compaction", 1, "continues", False),
                         ("subagent", 3, "continues", False)]
    assert [_first_user(t, t.sessions[k], recs) for k in (1, 2, 4)] == [P.QA, P.QB, P.QA]
    comp = t.sessions[3]
    assert comp.meta["parent_by"] == "history" and comp.meta["parent_score"] == 1.0
    assert comp.state_before == StateRef(session=1, upto=len(t.sessions[1].tokens()))
    assert t.resolve_state(comp.state_after) == t.sessions[4].prompt_ids
    # The researcher's result came from its continuation; the fork's states are the lead's.
    sub = t.sessions[1]
    assert "RESULT for" in rnd.decode(t.resolve_state(sub.state_after)[sub.state_before.upto:])
    assert t.answer == answer and answer.startswith("ANSWER:") and t.end_reason == "answer"
    assert not t.meta["unlinked_sessions"]
    _exact(t, recs)


@pytest.mark.parametrize("posted", [None, "the posted answer"])
def test_subagent_whose_result_is_returned_directly(rnd, posted):
    recs, result = P.run(P.result_returned_directly, rnd, "p2")
    t = reconstruct_rollout(recs, RewardRecord("p2", 1.0, answer=posted))
    assert _shape(t) == [("main", None, None, True), ("subagent", 0, "forks", False)]
    lead, sub = t.sessions
    calling = next(r for r in recs if r.call_id == lead.meta["call_ids"][-1])
    assert sub.meta["parent_by"] == "tool_call" and sub.meta["forked_by_call"] == calling.call_id
    assert sub.meta["result_unseen"] is True
    assert sub.state_before == StateRef(session=0, upto=len(calling.prompt_ids))
    assert sub.state_after == StateRef(session=0, upto=len(calling.tip()))
    if posted is None:
        assert t.answer == result and result.startswith("RESULT for")
        assert t.meta["answer_from"] == "subagent 1" and t.end_reason == "subagent_result"
    else:
        assert t.answer == posted and t.meta["answer_from"] == "reward"
    _exact(t, recs)


def test_whitespace_dropped_when_turns_are_resent(rnd):
    recs, answer = P.run(P.whitespace_dropped, rnd, "p3a")
    t = reconstruct_rollout(recs, RewardRecord("p3a", 1.0))
    assert _shape(t) == [("main", None, None, True), ("subagent", 0, "forks", False)]
    lead, sub = t.sessions
    assert lead.num_turns == 4 and sub.num_turns == 3
    assert len(lead.meta["resent"]) == 3 and len(sub.meta["resent"]) == 2
    # each re-sent turn was rebuilt: the sampled tokens the harness re-sent differently were detached
    assert all(r["detached_tokens"] > 0 for r in lead.meta["resent"] + sub.meta["resent"])
    assert t.meta["drift_repairs"] == 5 == len(lead.detached) + len(sub.detached)
    assert not any("diverged_from" in s.meta for s in t.sessions)
    assert t.answer == answer and t.sessions[0].end_reason == "stop"
    _exact(t, recs)
    # Without message matching every re-sent turn opens a session (the old behaviour, flagged).
    old = reconstruct_rollout(recs, rules=ReconstructionRules(message_match=False))
    assert len(old.sessions) > 2 and any("diverged_from" in s.meta for s in old.sessions)


def test_cut_reply_resent_differently_keeps_the_subagent(rnd):
    """Issue 33 item 11: a reply cut at max_tokens and re-sent differently used to open a new session,
    which then took the sub-agent for a compaction by output (kinds {main, compaction} only)."""
    recs, answer = P.run(P.cut_reply_resent, rnd, "p11")
    t = reconstruct_rollout(recs, RewardRecord("p11", 1.0))
    assert _shape(t) == [("main", None, None, False), ("subagent", 0, "forks", False),
                         ("compaction", 0, "continues", False), ("main", 2, "continues", True)]
    lead = t.sessions[0]
    assert [r["call_id"] for r in lead.meta["resent"]] == [lead.meta["call_ids"][1]]
    assert t.meta["drift_repairs"] == 1 and t.meta["drift_detached_tokens"] > 0
    assert t.answer == answer
    _exact(t, recs)


def test_leaked_markup_is_not_taken_for_a_compaction(rnd):
    recs, answer = P.run(P.leaked_markup, rnd, "p3b")
    t = reconstruct_rollout(recs, RewardRecord("p3b", 1.0))
    assert _shape(t) == [("main", None, None, True), ("subagent", 0, "forks", False)]
    lead, sub = t.sessions
    assert lead.meta["resent"][0]["call_id"] == lead.meta["call_ids"][1]
    assert t.meta["drift_repairs"] == 1 == len(lead.detached) and not sub.detached
    assert sub.meta["parent_by"] == "result"
    assert "RESULT for" in rnd.decode(t.resolve_state(sub.state_after)[sub.state_before.upto:])
    assert t.answer == answer
    _exact(t, recs)


def test_context_overflow_prompt_is_in_the_compacted_history(rnd):
    recs, answer = P.run(P.overflow_then_compact, rnd, "p4", max_context=760)
    over = next(r for r in recs if r.context_overflow)
    t = reconstruct_rollout(recs, RewardRecord("p4", 1.0))
    assert _shape(t) == [("main", None, None, False), ("compaction", 0, "continues", False),
                         ("main", 1, "continues", True)]
    lead, comp, succ = t.sessions
    assert lead.meta["call_ids"][-1] == over.call_id and lead.end_reason == "context_overflow"
    assert lead.num_turns == 3 and t.meta["overflow_calls"] == [over.call_id] and not t.meta["errored_calls"]
    # The compaction starts from the overflowing prompt: the long search result is in it.
    assert comp.state_before == StateRef(session=0, upto=len(over.prompt_ids))
    assert t.resolve_state(comp.state_before) == over.prompt_ids
    assert lead.loss_mask[len(over.prompt_ids) - len(lead.prompt_ids) - 1] is False
    assert comp.meta["parent_by"] == "history"
    assert t.answer == answer and succ.end_reason == "stop"
    _exact(t, recs)


def test_a_compaction_without_evidence_falls_back_to_recency_and_says_so(rnd):
    recs, _ = P.run(P.overflow_then_compact, rnd, "p4", max_context=760)
    summ = next(r for r in recs if r.messages[0]["content"] == P.SUMMARISER_SYS)
    summ.messages = [summ.messages[0], {"role": "user", "content": P.SUMMARY_ASK + "(history elided)"}]
    t = reconstruct_rollout(recs)
    comp = t.sessions[1]
    assert comp.kind == "compaction" and comp.parent == 0 and comp.meta["parent_by"] == "recency"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(st.fixed_dictionaries({"searches": st.integers(0, 3), "compact_before": st.none() | st.integers(1, 2),
                                            "ws": st.booleans()}), min_size=1, max_size=3),
       lead_searches=st.integers(0, 2), lead_ws=st.booleans(), patterns=st.booleans())
def test_random_teams_rebuild_to_their_graph(plan, lead_searches, lead_ws, patterns):
    """Researchers in parallel, some compacting their own history, some writing whitespace the
    harness drops: every session is where it belongs, whatever the mix, with or without the
    instruction patterns (then compactions are found by output)."""
    rnd = Renderer(_tok())
    recs, answer = P.run(lambda llm: P.random_team(llm, plan, lead_searches, lead_ws), rnd, "team")
    rules = ReconstructionRules() if patterns else ReconstructionRules(compaction_patterns=())
    t = reconstruct_rollout(recs, RewardRecord("team", 1.0), rules)
    by_id = {r.call_id: r for r in recs}

    def role(s):
        first = by_id[s.meta["call_ids"][0]]
        sys_, users = first.messages[0]["content"], [m["content"] for m in first.messages if m["role"] == "user"]
        if sys_ == P.LEAD_SYS:
            return ("lead", None)
        q = next(k for k in range(len(plan)) if f"landmark {k}?" in users[0])
        if sys_ == P.SUMMARISER_SYS:
            return ("compaction", q)
        return ("continuation" if len(users) > 1 else "head", q)

    roles = [role(s) for s in t.sessions]
    compacts = [p["compact_before"] is not None and p["searches"] > p["compact_before"] for p in plan]
    assert sorted(roles, key=str) == sorted(
        [("lead", None)] + [("head", k) for k in range(len(plan))]
        + [(r, k) for k, c in enumerate(compacts) if c for r in ("compaction", "continuation")], key=str)
    idx = {r: i for i, r in enumerate(roles)}
    assert roles[0] == ("lead", None) and t.sessions[0].is_final and t.answer == answer
    for (r, k), s in zip(roles, t.sessions):
        want = {"lead": (None, None, "main"), "head": (idx[("lead", None)], "forks", "subagent"),
                "compaction": (idx.get(("head", k)), "continues", "compaction"),
                "continuation": (idx.get(("compaction", k)), "continues", "subagent")}[r]
        assert (s.parent, s.edge, s.kind) == want, (r, k, s.meta)
    assert not t.meta["unlinked_sessions"] and not any("diverged_from" in s.meta for s in t.sessions)
    _exact(t, recs)


def test_export_summary_counts_the_drift_repairs(rnd, tmp_path):
    from mosaic.capture.cli import export
    from mosaic.capture.records import RecordWriter
    from mosaic.trace import load_trajectories

    recs, _ = P.run(P.whitespace_dropped, rnd, "p3a")
    w = RecordWriter(tmp_path / "records" / "records.jsonl")
    for r in recs + [RewardRecord("p3a", 1.0)]:
        w.write(r)
    w.close()
    summary = export(str(tmp_path / "records"), str(tmp_path / "out.jsonl"))
    assert summary["drift_repairs"] == 5 and summary["drift_detached_tokens"] > 0
    (t,) = load_trajectories(tmp_path / "out.jsonl")
    _exact(t, recs)  # the detached stretches survive the file


@pytest.mark.parametrize("with_researcher", [False, True])
def test_a_harness_that_resets_its_context_rebuilds_as_reset_sessions(rnd, with_researcher):
    """Issue 30: an HMA-style harness restarts the agent every two actions from the system prompt, the task
    and its notes; the proxy's records rebuild as a chain of ``reset`` sessions (not unrelated mains), the
    last one final, with the states of docs/algorithm.md §4.4 (prompt → the next session's prompt)."""
    recs, answer = P.run(lambda llm: P.context_resets(llm, 3, with_researcher), rnd, "p5")
    t = reconstruct_rollout(recs, RewardRecord("p5", 1.0, ground_truth="x"))
    resets = [s for s in t.sessions if s.kind == "reset"]
    assert [(s.parent, s.edge) for s in resets] == [(None, None), (0, "continues"), (1, "continues")]
    assert resets[-1].is_final and t.meta["unlinked_sessions"] == []
    assert [s.meta.get("by") for s in resets] == [None, "reset", "reset"]
    for a, b in zip(resets, resets[1:]):
        assert a.state_before == StateRef(session=a.id, upto=len(a.prompt_ids))
        assert a.state_after == StateRef(session=b.id, upto=len(b.prompt_ids))
    if with_researcher:
        sub = [s for s in t.sessions if s.kind == "subagent"]
        assert len(sub) == 1 and sub[0].parent == resets[1].id
    _exact(t, recs)
    # the estimators and the per-kind statistics take the rebuilt graph as it is
    from mosaic.train.batch import advantage_batch
    from mosaic.core.estimators import get_estimator
    b = advantage_batch([t], [0.1] * len(t.sessions))
    adv, _ = get_estimator("mosaic")(b)
    assert adv.shape == (len(t.sessions),)
