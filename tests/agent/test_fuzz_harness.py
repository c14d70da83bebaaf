"""Fuzz: >= 10,000 malformed model outputs through the agent loop never crash it (docs/algorithm.md §2)."""

import pytest

from mosaic.trace import turn_boundaries

from mosaic.agent.chat import ChatFormat
from mosaic.agent.harness import Harness, HarnessConfig
from _doubles import FUZZ_KINDS, FakeEnv, FakeTask, FuzzPolicy, RecordingPolicy
from mosaic.agent.tokenizer import train_tokenizer

END_REASONS = {"answer", "turn_cap", "total_turn_cap", "session_cap", "context_overflow"}


@pytest.fixture(scope="module")
def chat():
    corpus = ['<tool_call>{"name": "search", "arguments": {"query": "Ruo Ces works"}}</tool_call>',
              "Error (bad_json): the tool call is not valid JSON.", "[1] Doc 1: about word word"] * 30
    return ChatFormat(train_tokenizer(corpus, vocab_size=600))


def inserted_text(chat, s):
    """The harness-inserted spans of a session's completion (tool responses, headers), decoded."""
    spans, cur = [], []
    for tok, m in zip(s.completion_ids, s.loss_mask):
        if m:
            if cur:
                spans.append(cur)
            cur = []
        else:
            cur.append(tok)
    if cur:
        spans.append(cur)
    return [chat.decode(sp) for sp in spans]


def test_fuzz_outputs_become_readable_errors(chat):
    fuzz = FuzzPolicy(chat.tokenizer, seed=1234)
    policy = RecordingPolicy(fuzz)
    cfg = HarnessConfig(mode="compaction+fork", context_budget=1500, max_new_tokens=64, summary_max_new_tokens=48,
                        max_turns=40, max_sessions=30, max_total_turns=70, subagent_max_turns=4, max_depth=2,
                        max_arg_chars=64)
    tasks = [FakeTask(f"f{i}", f"Question {i}?", "Ama Rell") for i in range(80)]
    trajs = Harness(policy, chat, FakeEnv(words_per_hit=2), cfg).run(tasks, group_size=4, seed=0)

    n_outputs = len(policy.calls)
    assert n_outputs >= 10_000, n_outputs
    assert set(fuzz.counts) == set(FUZZ_KINDS)
    invalid = sum(t.meta["num_invalid"] for t in trajs)
    calls = sum(sum(t.meta["tool_calls"].values()) for t in trajs)
    answers = sum(t.end_reason == "answer" for t in trajs) + sum(t.meta["subagent_answers"] for t in trajs)
    turns = sum(t.meta["turns"] for t in trajs)
    compaction_turns = sum(t.meta["compactions"] for t in trajs)
    # every main/subagent turn is exactly one of: invalid action, tool call, answer
    assert turns == invalid + calls + answers
    assert turns + compaction_turns == n_outputs
    assert invalid > 0.8 * turns
    kinds_seen = set()
    for t in trajs:
        kinds_seen |= set(t.meta["invalid_actions"])
        assert t.end_reason in END_REASONS, t.end_reason
        assert len(t.sessions) <= cfg.max_sessions and t.meta["turns"] <= cfg.max_total_turns
        for s in t.sessions:
            cap = {"main": cfg.max_turns, "subagent": cfg.subagent_max_turns, "compaction": 1}[s.kind]
            assert s.num_turns <= cap
        boundary = [chat.im_end_id] + chat.newline_ids
        for s in t.sessions:  # every state and probe point still ends at a message boundary
            refs = [r for r in (s.state_before, s.state_after) if r is not None]
            assert all(t.resolve_state(r)[-2:] == boundary for r in refs)
            assert all(s.tokens()[:b][-2:] == boundary for b in turn_boundaries(s, chat.generation_header_ids))
        # each invalid action left an error message the model can read, in a tool response
        errors = sum(sp.count("<tool_response>\nError (") for s in t.sessions for sp in inserted_text(chat, s))
        assert errors == t.meta["num_invalid"] + t.meta["subagent_failures"] + t.meta["tool_errors"]
    assert {"no_action", "bad_json", "unknown_tool", "bad_arguments", "unclosed_tool_call", "bad_call",
            "argument_too_long", "malformed_tool_call", "malformed_answer", "delegate_depth"} <= kinds_seen
    for req, res in policy.calls:
        assert len(res.token_ids) <= req.max_new_tokens
