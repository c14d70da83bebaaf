"""Session reconstruction from call records: longest prefix, retries, compaction, ambiguous cases."""

from __future__ import annotations

import dataclasses
import random

import pytest

from mosaic.capture.records import CallRecord, RewardRecord
from mosaic.capture.reconstruct import ReconstructionRules, reconstruct, reconstruct_rollout
from mosaic.capture.scripted import Renderer, build_tokenizer
from mosaic.trace import read_jsonl, read_parquet, to_rows, validate, write_jsonl, write_parquet
from ._harness import offline_rollout

TASK = "What is the fact about the river?"


@pytest.fixture(scope="module")
def rnd():
    return Renderer(build_tokenizer())


@pytest.fixture(scope="module")
def rollout(rnd):
    recs, answer = offline_rollout(rnd, "r0", TASK)
    return recs, answer


def _shape(t):
    return [(s.kind, s.parent, s.edge, s.is_final) for s in t.sessions]


EXPECTED = [
    ("main", None, None, False),
    ("subagent", 0, "forks", False),
    ("subagent", 0, "forks", False),
    ("compaction", 0, "continues", False),
    ("main", 3, "continues", True),
]


def test_interleaved_subagents_rebuild_the_real_graph(rollout):
    recs, _ = rollout
    # The two subagents really interleave: alpha, beta, alpha, beta.
    firsts = [r.messages[1]["content"][:12] for r in recs if r.messages[0]["content"].startswith("You are a subagent")]
    assert firsts[0] != firsts[1] and firsts[0] == firsts[2] and firsts[1] == firsts[3]
    t = reconstruct_rollout(recs, RewardRecord("r0", 1.0, ground_truth="x"))
    assert _shape(t) == EXPECTED
    assert t.success and t.reward == 1.0 and t.ground_truth == "x"
    assert t.sessions[1].num_turns == 2 and t.sessions[2].num_turns == 2
    assert t.sessions[0].num_turns == 4  # task fork, then three ls turns before the compaction


def test_previous_call_matching_would_fragment(rollout):
    """The peers' rule (extend only the immediately previous call) splits the interleaved subagents."""
    recs, _ = rollout
    ordered = sorted(recs, key=lambda r: (r.t_start, r.seq))
    pieces = 1 + sum(1 for a, b in zip(ordered, ordered[1:]) if b.prompt_ids[: len(a.tip())] != a.tip())
    t = reconstruct_rollout(recs)
    assert pieces > len(t.sessions)


def test_input_order_does_not_matter(rollout):
    recs, _ = rollout
    shuffled = list(recs)
    random.Random(0).shuffle(shuffled)
    assert [s.to_dict() for s in reconstruct_rollout(shuffled).sessions] == \
        [s.to_dict() for s in reconstruct_rollout(recs).sessions]


def test_tokens_are_exactly_the_calls(rollout):
    recs, _ = rollout
    by_id = {r.call_id: r for r in recs}
    t = reconstruct_rollout(recs)
    for s in t.sessions:
        calls = [by_id[c] for c in s.meta["call_ids"]]
        assert s.prompt_ids == calls[0].prompt_ids
        assert s.tokens() == calls[-1].tip()
        pos = 0
        toks = s.tokens()
        for c in calls:
            start = len(c.prompt_ids)
            # everything from the previous tip to this prompt's end was inserted (mask False)
            assert all(not m for m in s.loss_mask[pos: start - len(s.prompt_ids)])
            seg = slice(start - len(s.prompt_ids), start - len(s.prompt_ids) + len(c.completion_ids))
            assert s.completion_ids[seg] == c.completion_ids
            assert all(s.loss_mask[seg])
            assert s.logprobs[seg] == c.logprobs
            assert toks[: start] == c.prompt_ids
            pos = seg.stop
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if not m)
        assert s.num_trainable == sum(len(c.completion_ids) for c in calls)


def test_states_follow_spec(rollout):
    recs, _ = rollout
    t = reconstruct_rollout(recs)
    main, sub, _, comp, new_main = t.sessions
    assert main.state_before.session == 0 and main.state_before.upto == len(main.prompt_ids)
    # subagent: parent's context before the turn that forked it → after the results were inserted
    assert sub.state_before.session == 0 and sub.state_before.upto == len(main.prompt_ids)
    after = t.resolve_state(sub.state_after)
    assert "RESULT" in build_tokenizer().decode(after[sub.state_before.upto:])
    # compaction: the parent's context when it started → the successor's prompt
    assert comp.state_before.session == 0 and comp.state_before.upto == len(main.tokens())
    assert t.resolve_state(comp.state_after) == new_main.prompt_ids


def test_retry_dedup_keeps_the_last(rollout):
    recs, _ = rollout
    # A retried subagent call (same prompt, earlier, a different answer nothing used) is dropped.
    sub_first = recs[3]
    retry = dataclasses.replace(sub_first, call_id="retry", seq=-1, t_start=sub_first.t_start - 0.1,
                                completion_ids=sub_first.completion_ids[:-3], text="partial answer")
    t = reconstruct_rollout(recs + [retry])
    assert t.meta["retries_dropped"] == ["retry"]
    assert _shape(t) == EXPECTED
    # A retried final call: both unused, keep the last one.
    last = recs[-1]
    again = dataclasses.replace(last, call_id="again", seq=99, t_start=last.t_start + 0.1,
                                completion_ids=last.completion_ids[:-1] + [5, last.completion_ids[-1]])
    t = reconstruct_rollout(recs + [again])
    assert t.meta["retries_dropped"] == [last.call_id]
    assert t.sessions[-1].meta["call_ids"][-1] == "again"
    assert t.sessions[-1].tokens() == again.tip()


def test_compaction_found_by_output_without_patterns(rollout):
    recs, _ = rollout
    t = reconstruct_rollout(recs, rules=ReconstructionRules(compaction_patterns=()))
    assert _shape(t) == EXPECTED
    assert t.sessions[3].meta["by"] == "output"


def test_compaction_that_extends_the_main_history(rnd):
    """The Mosaic harness style: the compaction prompt is the history + an instruction."""
    sys_ = {"role": "system", "content": "sys"}
    u = {"role": "user", "content": "task: find it"}
    msgs = [sys_, u]
    recs = []

    def call(i, messages, text):
        p = rnd.chat_prompt(messages, None)
        c = rnd.completion(text)
        recs.append(CallRecord(call_id=f"c{i}", rollout_id="m", seq=i, endpoint="chat", messages=messages,
                               prompt_ids=p, completion_ids=c, logprobs=[-0.1] * len(c), text=text,
                               finish_reason="stop", t_start=float(i), t_end=i + 0.5))

    call(0, msgs, "thinking about the river")
    msgs = msgs + [{"role": "assistant", "content": "thinking about the river"},
                   {"role": "user", "content": "Summarize the conversation so far."}]
    call(1, msgs, "Summary: the river is long and wide indeed.")
    call(2, [sys_, u, {"role": "user", "content": "Summary: the river is long and wide indeed."}], "ANSWER: river")
    t = reconstruct_rollout(recs)
    assert _shape(t) == [("main", None, None, False), ("compaction", 0, "continues", False),
                         ("main", 1, "continues", True)]
    comp = t.sessions[1]
    assert comp.meta["by"] == "instruction"
    assert comp.state_before.upto == len(recs[0].tip())
    assert comp.prompt_ids[: len(recs[0].tip())] == recs[0].tip()


def _raw(i, prompt, comp, text="", rid="a", messages=None):
    return CallRecord(call_id=f"c{i}", rollout_id=rid, seq=i, endpoint="chat",
                      messages=messages or [{"role": "user", "content": f"m{i}"}],
                      prompt_ids=list(prompt), completion_ids=list(comp), logprobs=[-0.5] * len(comp),
                      text=text, finish_reason="stop", t_start=float(i), t_end=i + 0.5)


def test_ambiguous_equal_tips_take_the_oldest_and_say_so():
    root = _raw(0, [1, 2, 3], [4])
    s1 = _raw(1, [9, 9], [7, 7])
    s2 = _raw(2, [9, 9], [7, 7])  # the same prompt and reply: two open sessions with equal tips
    c1 = _raw(3, [9, 9, 7, 7, 50], [8])  # extends both; the oldest (s1) gets it
    c2 = _raw(4, [9, 9, 7, 7, 60], [8])  # s1's tip is now longer and not a prefix; only s2 fits
    t = reconstruct_rollout([root, s1, s2, c1, c2])
    assert [s.meta["call_ids"] for s in t.sessions] == [["c0"], ["c1", "c3"], ["c2", "c4"]]
    assert t.sessions[1].meta["ambiguous_with"] == [{"call_id": "c3", "sessions": [2]}]
    assert "ambiguous_with" not in t.sessions[2].meta
    t = reconstruct_rollout([root, s1, s2, c1, c2], rules=ReconstructionRules(tie_break="newest"))
    assert [s.meta["call_ids"] for s in t.sessions] == [["c0"], ["c1", "c4"], ["c2", "c3"]]
    # Equal prompts that are both extended are not retries.
    assert t.meta["retries_dropped"] == []


def test_a_prompt_that_matches_nothing_opens_an_unlinked_main():
    root = _raw(0, [1, 2, 3], [4], text="first")
    cont = _raw(1, [1, 2, 3, 4, 5], [6], text="done")
    stray = _raw(2, [40, 41], [42], text="unrelated words nobody quotes")
    t = reconstruct_rollout([root, cont, stray])
    assert _shape(t) == [("main", None, None, True), ("main", None, None, False)]
    assert t.sessions[1].meta["unlinked"] is True and t.meta["unlinked_sessions"] == [1]
    assert t.sessions[0].loss_mask == [True, False, True]


def test_errored_and_id_less_calls_are_left_out():
    ok = _raw(0, [1, 2], [3])
    bad = dataclasses.replace(_raw(1, [1, 2, 3, 4], [5]), status=502, error="upstream unreachable")
    noids = dataclasses.replace(_raw(2, [], []), error=None)
    t = reconstruct_rollout([ok, bad, noids])
    assert len(t.sessions) == 1 and t.meta["errored_calls"] == ["c1", "c2"]
    assert reconstruct_rollout([bad]) is None


def test_reconstruct_groups_rollouts_and_needs_rewards(rnd):
    a, _ = offline_rollout(rnd, "ra", TASK)
    b, _ = offline_rollout(rnd, "rb", "Another question about a city?")
    with pytest.warns(UserWarning, match="no reward"):
        ts = reconstruct(a + b, {"ra": RewardRecord("ra", 0.0, task_id="t1", group_id="g")})
    assert [t.id for t in ts] == ["ra"] and ts[0].group_id == "g" and ts[0].task_id == "t1"
    ts = reconstruct(a + b, {}, ReconstructionRules(include_unrewarded=True))
    assert [t.id for t in ts] == ["ra", "rb"] and all(t.meta["reward_missing"] for t in ts)


def test_storage_and_rows_work_unchanged(rollout, tmp_path):
    recs, _ = rollout
    t = reconstruct_rollout(recs, RewardRecord("r0", 1.0, ground_truth="FACT"))
    write_jsonl(tmp_path / "t.jsonl", [t])
    write_parquet(tmp_path / "t.parquet", [t])
    for back in (read_jsonl(tmp_path / "t.jsonl")[0], read_parquet(tmp_path / "t.parquet")[0]):
        validate(back)
        assert [s.tokens() for s in back.sessions] == [s.tokens() for s in t.sessions]
        assert [s.loss_mask for s in back.sessions] == [s.loss_mask for s in t.sessions]
    rows = to_rows([t])
    assert [r.kind for r in rows] == ["main", "subagent", "subagent", "compaction", "main"]
    assert sum(r.num_trainable for r in rows) == sum(len(r.completion_ids) for r in recs)


def test_rules_validate_their_fields():
    with pytest.raises(ValueError, match="compaction_patterns"):
        ReconstructionRules(compaction_patterns=("(",))
    with pytest.raises(ValueError, match="tie_break"):
        ReconstructionRules(tie_break="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_match_chars"):
        ReconstructionRules(min_match_chars=0)
