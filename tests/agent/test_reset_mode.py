"""Context-reset sessions (``harness.mode=reset``, issue 30): fresh contexts, the notes workspace, the
action cap, hand-offs, the graph's states, storage round trips, and the scripted expert."""

from __future__ import annotations

import json

import pytest

from mosaic.agent.chat import ChatFormat
from mosaic.agent.harness import Harness, HarnessConfig
from mosaic.agent.tokenizer import train_tokenizer
from mosaic.trace import read_jsonl, read_parquet, validate, write_jsonl, write_parquet
from _doubles import FakeEnv, FakeTask, RecordingPolicy, TextPolicy

TASK = FakeTask("t0", "Who is the founder of Ruo Ces?", "Ama Rell")


def call(name: str, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


@pytest.fixture(scope="module")
def chat():
    corpus = [call("search", query="Ruo Ces founder"), call("note_write", text="Ruo Ces founder: Ama Rell"),
              call("handoff", note="next: Ama Rell"), "Doc about Ruo Ces works word word", "Notes (4 tool calls)",
              "<answer>Ama Rell</answer>"] * 30
    return ChatFormat(train_tokenizer(corpus, vocab_size=500))


def run(chat, fn, group=1, **cfg):
    policy = RecordingPolicy(TextPolicy(chat.tokenizer, fn))
    h = Harness(policy, chat, FakeEnv(), HarnessConfig(mode="reset", **cfg))
    return h.run([TASK], group_size=group), policy


def script(turns):
    """The policy's text per (session, turn) from a list of lists; past the end: search."""
    def fn(r):
        s, k = r.meta["session"], r.meta["turn"]
        return turns[s][k] if s < len(turns) and k < len(turns[s]) else call("search", query="Ruo Ces")
    return fn


def test_notes_carry_over_a_fresh_context_and_the_states_chain(chat):
    (t,), pol = run(chat, script([[call("search", query="Ruo Ces founder"), call("note_write", text="Ruo Ces founder: Ama Rell"),
                                   call("handoff", note="next: answer")],
                                  ["<answer>Ama Rell</answer>"]]), context_budget=2000, max_new_tokens=64)
    assert t.end_reason == "answer" and t.success and [s.kind for s in t.sessions] == ["reset", "reset"]
    s0, s1 = t.sessions
    assert (s1.parent, s1.edge, s0.end_reason, s0.num_turns) == (0, "continues", "handoff", 3)
    assert s0.meta["notes_before"] == [] and s0.meta["notes_after"] == ["Ruo Ces founder: Ama Rell", "next: answer"]
    assert s1.meta["notes_before"] == s0.meta["notes_after"] and t.meta["notes"] == s0.meta["notes_after"]
    assert t.meta["resets"] == 1 and t.meta["notes_written"] == 2 and s1.is_final and not s0.is_final
    # a fresh context: the second session's prompt is system + question + notes, none of the first one's turns
    p1 = chat.decode(s1.prompt_ids)
    assert "- Ruo Ces founder: Ama Rell\n- next: answer" in p1 and "Doc 1: about" not in p1
    assert s1.prompt_ids[: len(s0.prompt_ids) - 8] != s0.prompt_ids[: len(s0.prompt_ids) - 8]  # the notes differ
    # states (docs/algorithm.md §4.4): before = its own prompt, after = the next session's prompt (one reference)
    assert s0.state_before.session == 0 and s0.state_after == s1.state_before and s1.state_before.session == 1
    assert t.resolve_state(s0.state_after) == s1.prompt_ids[: s1.state_before.upto]
    assert pol.released == ["t0/0/0", "t0/0/1"]  # no cache hand-off: nothing of the old context is kept


def test_the_action_cap_ends_each_session_and_the_session_cap_the_trajectory(chat):
    (t,), _ = run(chat, lambda r: call("search", query="Ruo Ces"), context_budget=4000, max_new_tokens=64,
                  reset_k=3, max_sessions=4, max_total_turns=100)
    assert t.end_reason == "session_cap" and len(t.sessions) == 4 and t.reward == 0
    assert [s.end_reason for s in t.sessions[:3]] == ["reset_cap"] * 3 and all(s.num_turns == 3 for s in t.sessions[:3])
    for a, b in zip(t.sessions, t.sessions[1:]):
        assert a.state_after == b.state_before


def test_a_note_past_the_workspace_budget_is_refused_and_counted(chat):
    long = "Ruo Ces founder Ama Rell " * 2  # 49 characters once its spaces are normalised
    (t,), pol = run(chat, script([[call("note_write", text="short note"), call("note_write", text=long),
                                   "<answer>no</answer>"]]), context_budget=2000, max_new_tokens=128, workspace_chars=40)
    assert t.meta["notes"] == ["short note"] and t.meta["workspace_full"] == 1
    replies = chat.decode(t.sessions[0].completion_ids)
    assert "Error (workspace_full): the notes hold 10 of 40 characters; a note of 49 does not fit" in replies


def test_a_context_that_fills_up_resets_and_a_fresh_one_that_overflows_ends(chat):
    (t,), _ = run(chat, lambda r: "<answer>x</answer>", context_budget=4000, max_new_tokens=64)
    room = len(t.sessions[0].prompt_ids) + len(chat.generation_header_ids) + 64 + 10  # one turn fits, not two
    (t,), _ = run(chat, lambda r: call("search", query="Ruo Ces"), context_budget=room, reset_context_budget=0,
                  max_new_tokens=64, reset_k=50, max_sessions=3, max_total_turns=100)
    assert t.sessions[0].end_reason == "context_reset" and t.sessions[0].num_turns >= 1
    # a budget that cannot hold even a fresh prompt and one reply is refused before any rollout
    with pytest.raises(ValueError, match="reset_context_budget: a fresh reset session's prompt is"):
        run(chat, lambda r: call("search", query="Ruo Ces"), context_budget=120, reset_context_budget=0,
            max_new_tokens=64)
    # one that does, until the notes grow: the next fresh session overflows and ends the trajectory
    long = "Ruo Ces founder Ama Rell word word " * 3
    (t,), _ = run(chat, lambda r: call("handoff", note=long), context_budget=room, reset_context_budget=0,
                  max_new_tokens=64, workspace_chars=2000)
    assert t.end_reason == "context_overflow" and len(t.sessions) >= 2 and t.sessions[-1].num_turns == 0
    assert all(s.num_turns == 1 for s in t.sessions[:-1]) and len(t.meta["notes"]) == len(t.sessions) - 1


def test_reset_counts_reach_the_rollout_summary_and_the_training_logs(chat):
    from mosaic.agent.cli import summarize
    from mosaic.train.metrics import rollout_metrics

    long = "Ruo Ces founder Ama Rell " * 2
    trajs, _ = run(chat, script([[call("note_write", text="short note"), call("note_write", text=long),
                                  call("handoff", note="go")], ["<answer>Ama Rell</answer>"]]), group=2,
                   context_budget=2000, max_new_tokens=64, workspace_chars=40)
    m, s = rollout_metrics(trajs), summarize(trajs)
    assert m["reset/resets"] == s["reset_resets"] == 1.0 and m["reset/workspace_full"] == 1.0
    assert m["reset/notes_written"] == 2.0 and m["reset/partner_sessions"] == 0.0
    (single,), _ = run(chat, lambda r: "<answer>x</answer>", context_budget=2000, max_new_tokens=64)
    single.meta = {k: v for k, v in single.meta.items() if k not in ("resets",)}  # (as another mode records it)
    assert not any(k.startswith("reset/") for k in rollout_metrics([single]))


def test_the_workspace_round_trips_through_jsonl_and_parquet(chat, tmp_path):
    trajs, _ = run(chat, script([[call("note_write", text="Ruo Ces founder: Ama Rell \u00e9"), call("handoff", note="go")],
                                 ["<answer>Ama Rell</answer>"]]), group=2, context_budget=2000, max_new_tokens=64)
    write_jsonl(tmp_path / "r.jsonl", trajs)
    write_parquet(tmp_path / "r.parquet", trajs)
    for back in (read_jsonl(tmp_path / "r.jsonl"), read_parquet(tmp_path / "r.parquet")):
        assert [validate(t).to_dict() for t in back] == [t.to_dict() for t in trajs]
        assert back[0].sessions[1].meta["notes_before"] == ["Ruo Ces founder: Ama Rell \u00e9", "go"]


def test_config_checks():
    with pytest.raises(ValueError, match="reset_k"):
        HarnessConfig(mode="reset", reset_k=1)
    with pytest.raises(ValueError, match="workspace_chars.*refuses every note"):  # (1 char: every note refused)
        HarnessConfig(mode="reset", workspace_chars=31)
    with pytest.raises(ValueError, match="reset_template"):
        HarnessConfig(mode="reset", reset_template="no placeholders")
    with pytest.raises(ValueError, match="must be < reset_context_budget"):
        HarnessConfig(mode="reset", context_budget=2048, reset_context_budget=256, max_new_tokens=256)
    c = HarnessConfig(mode="reset", context_budget=512, reset_context_budget=1024)
    assert c.tools() == ("search", "note_write", "handoff") and c.budget("reset") == 1024 and c.budget("main") == 512
    assert "(empty)" in c.reset_text("Q?", []) and "- a\n- b" in c.reset_text("Q?", ["a", "b"])


ROLES = ("searcher: find the facts and note them", "checker: check the notes and answer")


def test_two_roles_alternate_and_a_partner_plays_the_second_untrained(chat):
    mine = RecordingPolicy(TextPolicy(chat.tokenizer, lambda r: call("handoff", note=f"from role {r.meta['role']}")
                                      if r.meta["session"] < 3 else "<answer>Ama Rell</answer>"))
    theirs = RecordingPolicy(TextPolicy(chat.tokenizer, lambda r: call("handoff", note="partner was here")))
    cfg = HarnessConfig(mode="reset", context_budget=4000, max_new_tokens=64, reset_roles=ROLES, partner="expert")
    (t,) = Harness(mine, chat, FakeEnv(), cfg, partner=theirs).run([TASK])
    assert [s.meta["role"] for s in t.sessions] == [0, 1, 0, 1, 0] and t.success and t.sessions[4].is_final
    assert [bool(s.meta.get("partner")) for s in t.sessions] == [False, True, False, True, False]
    assert {r.meta["session"] for r, _ in theirs.calls} == {1, 3} and {r.meta["session"] for r, _ in mine.calls} == {0, 2, 4}
    assert "Your role: checker" in chat.decode(t.sessions[1].prompt_ids)
    assert "Your role: searcher" in chat.decode(t.sessions[2].prompt_ids)
    for s in t.sessions:  # the partner's tokens are recorded, never trained
        assert any(s.loss_mask) != bool(s.meta.get("partner"))
    assert t.meta["partner_tokens"] > 0 and "partner was here" in t.meta["notes"]
    # every completion token is counted once: sampled (by us or the partner) or inserted by the harness
    assert t.meta["tokens_sampled"] + t.meta["tokens_inserted"] == sum(len(s.completion_ids) for s in t.sessions)
    assert theirs.released == ["t0/0/1", "t0/0/3"]


def test_partner_settings_are_checked():
    with pytest.raises(ValueError, match="reset_roles"):
        HarnessConfig(mode="compaction", reset_roles=ROLES)
    with pytest.raises(ValueError, match="reset_roles"):
        HarnessConfig(mode="reset", reset_roles=("only one",))
    with pytest.raises(ValueError, match="partner"):
        HarnessConfig(mode="reset", partner="expert")
    with pytest.raises(ValueError, match="needs mode='reset' and two reset_roles"):
        HarnessConfig(mode="compaction", partner="frozen")
    with pytest.raises(ValueError, match="give the harness its partner policy"):
        Harness(None, None, FakeEnv(), HarnessConfig(mode="reset", reset_roles=ROLES, partner="frozen"))
