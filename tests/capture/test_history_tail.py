"""A compaction's history past its parent's last reply (tool responses a harness sends only with the
instruction) ends the parent's row (docs/capture.md, rule 3; docs/algorithm.md §4.4: a main session's end state holds its
last tool response), located by rendering the call's messages as the server does."""

from __future__ import annotations

import json
from dataclasses import replace

from mosaic.agent.server.schema import ChatCompletionRequest
from mosaic.agent.server.textops import prefix_renderer, render_chat, template_messages
from mosaic.agent.tokenizer import load_tokenizer
from mosaic.capture.reconstruct import ReconstructionRules, reconstruct_rollout
from mosaic.capture.records import CallRecord, RewardRecord
from mosaic.train.setup import base_model_dir

TOK = load_tokenizer(base_model_dir("tiny"))
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
RULES = ReconstructionRules(render_prefix=prefix_renderer(TOK))
SYSTEM = {"role": "system", "content": "You answer questions with a search tool."}
ASK = {"role": "user", "content": "Who founded the Nidal Works?"}
INSTR = {"role": "user", "content": "Summarize the conversation so far for your successor."}


def _call(k: int, messages: list, reply: str, tool_calls=()) -> CallRecord:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    ids = TOK(render_chat(TOK, body), add_special_tokens=False)["input_ids"]
    comp = TOK(reply, add_special_tokens=False)["input_ids"] + [IM_END]
    return CallRecord(call_id=f"c{k}", rollout_id="r", seq=k, endpoint="chat", model="m", messages=messages,
                      prompt_ids=ids, completion_ids=comp, logprobs=[-0.1] * len(comp), text=reply,
                      tool_calls=list(tool_calls), finish_reason="stop", t_start=float(k), t_end=k + 0.5)


def _rollout(result_in_tail: str):
    """main: a search, then (a) the search result or (b) a sub-agent's answer sent only with the compaction
    instruction; the summary opens the next main session."""
    head = [SYSTEM, ASK]
    calls = []
    if result_in_tail == "search":
        reply = '<tool_call>{"name": "search", "arguments": {"query": "Nidal Works"}}</tool_call>'
        calls.append(_call(1, head, reply))
        result = {"role": "tool", "content": "Nidal Works: founded by Aba Rell in 1901."}
    else:  # (an OpenAI tool call, as the scripted harness of tests/train makes)
        reply = "I will ask a helper."
        call = {"id": "call-1", "type": "function",
                "function": {"name": "delegate", "arguments": json.dumps({"question": "Find the founder of the Nidal Works."})}}
        sampled = template_messages([{"role": "assistant", "content": reply, "tool_calls": [call]}], None,
                                    TOK.chat_template)[0][0]["content"]  # (the text the model sampled)
        calls.append(_call(1, head, sampled, [call]))
        calls.append(_call(2, [SYSTEM, {"role": "user", "content": "Find the founder of the Nidal Works."}],
                           "<answer>Aba Rell</answer>"))
        result = {"role": "tool", "tool_call_id": "call-1", "content": "<answer>Aba Rell</answer>"}  # (its reply, as is)
    said = {"role": "assistant", "content": reply, **({"tool_calls": calls[0].tool_calls} if calls[0].tool_calls else {})}
    history = head + [said, result]
    calls.append(_call(3, history + [INSTR], "The founder is Aba Rell."))
    calls.append(_call(4, head + [{"role": "user", "content": "Summary: The founder is Aba Rell."}],
                       "<answer>Aba Rell</answer>"))
    return calls, RewardRecord(rollout_id="r", reward=1.0, ground_truth="Aba Rell", answer="Aba Rell")


def test_the_last_tool_response_ends_the_compacted_session():
    calls, rw = _rollout("search")
    t = reconstruct_rollout(calls, rw, RULES, rollout_id="r")
    main, comp = t.sessions[0], t.sessions[1]
    assert comp.kind == "compaction" and comp.meta["history_tail"] == "added to the parent"
    row = list(main.prompt_ids) + list(main.completion_ids)
    assert TOK.decode(row).endswith("founded by Aba Rell in 1901.\n</tool_response><|im_end|>\n")
    assert main.state_after.upto is None and comp.state_before.upto == len(row)
    assert list(comp.prompt_ids[: len(row)]) == row  # the compaction starts from the parent's end state
    # without a renderer the tail stays in the compaction's prompt, flagged; the parent ends on its reply
    t0 = reconstruct_rollout(calls, rw, replace(RULES, render_prefix=None), rollout_id="r")
    assert t0.sessions[1].meta["history_tail"] == "in the compaction's prompt only"
    assert len(t0.sessions[0].completion_ids) == len(calls[0].completion_ids)


def test_a_subagent_result_seen_only_in_the_tail_ends_the_parent_state():
    calls, rw = _rollout("delegate")
    t = reconstruct_rollout(calls, rw, RULES, rollout_id="r")
    sub = next(s for s in t.sessions if s.kind == "subagent")
    main = t.sessions[sub.state_after.session]
    row = list(main.prompt_ids) + list(main.completion_ids)
    assert sub.state_after.upto == len(row) and TOK.decode(row).endswith("Aba Rell</answer>\n</tool_response><|im_end|>\n")
    assert "result_unseen" not in sub.meta


def test_a_message_that_is_not_an_object_does_not_crash_the_rebuild():
    calls, rw = _rollout("search")
    calls[1].messages[2] = "not a message"  # (records check only that messages is a list)
    t = reconstruct_rollout(calls, rw, RULES, rollout_id="r")
    assert t.sessions[1].meta["history_tail"] == "in the compaction's prompt only"


def test_a_reply_the_harness_re_sent_differently_keeps_the_tail_in_the_compaction():
    """The parent's row holds its reply as sampled; a compaction whose history renders that reply otherwise is
    linked by its history and the tail is left in its prompt (appending it would join a reply the server
    never rendered to the tool response)."""
    calls, rw = _rollout("search")
    c = calls[1]  # (the compaction call)
    said = dict(c.messages[2], content="(re-sent) " + c.messages[2]["content"])
    calls[1] = _call(3, [*c.messages[:2], said, *c.messages[3:]], c.text)
    t = reconstruct_rollout(calls, rw, RULES, rollout_id="r")
    comp = next(s for s in t.sessions if s.kind == "compaction")
    assert comp.meta["parent_by"] == "history" and comp.meta["history_tail"] == "in the compaction's prompt only"
    assert len(t.sessions[0].completion_ids) == len(calls[0].completion_ids)


def _resampled(call: CallRecord, cut: int) -> CallRecord:
    """``call`` as if the model had sampled its reply as other tokens than the template renders it with (the
    reply's text cut at character ``cut`` and each half tokenized alone)."""
    text = call.text
    ids = TOK(text[:cut], add_special_tokens=False)["input_ids"] + TOK(text[cut:], add_special_tokens=False)["input_ids"]
    assert ids != call.completion_ids[:-1]
    comp = ids + [IM_END]
    return replace(call, completion_ids=comp, logprobs=[-0.1] * len(comp))


def test_a_compaction_after_a_re_rendered_reply_belongs_to_that_session():
    """Rule 4 when the compaction's prompt extends no tip: the main session whose request and reply it re-sends
    (the reply re-rendered with other tokens) is its parent, and the graph is scorable."""
    from mosaic.train.external import unscorable

    calls, rw = _rollout("search")
    calls[0] = _resampled(calls[0], calls[0].text.index("Works") + 2)
    t = reconstruct_rollout(calls, rw, RULES, rollout_id="r")
    main, comp, nxt = t.sessions
    assert comp.kind == "compaction" and comp.parent == 0 and comp.meta["parent_by"] == "messages"
    assert comp.meta["history_tail"] == "in the compaction's prompt only"  # (the re-rendered reply: not found)
    assert comp.state_before.session == 0 and comp.state_before.upto == len(main.prompt_ids) + len(main.completion_ids)
    assert nxt.parent == comp.id and t.resolve_state(comp.state_after) == list(nxt.prompt_ids)
    assert unscorable(t) is None


def test_the_same_summary_twice_opens_a_second_session_not_a_retry():
    """Two compactions into the same summary: the third main session's prompt equals the second's. It came
    after calls that went on from the second, so it is a new session (rule 2 drops only re-sends made before
    anything went on from the earlier call), and the second compaction has its successor."""
    head = [SYSTEM, ASK]
    search = '<tool_call>{"name": "search", "arguments": {"query": "Nidal Works"}}</tool_call>'
    result = {"role": "tool", "content": "Nidal Works: an engine maker."}
    summary = "Found so far: nothing about the founder. Next: search Nidal Works founder."
    resumed = head[:1] + [{"role": "user", "content": ASK["content"] + "\n\nNotes: " + summary}]
    said = {"role": "assistant", "content": search}
    calls = [_call(1, head, search), _call(2, head + [said, result, INSTR], summary),
             _call(3, resumed, search), _call(4, resumed + [said, result, INSTR], summary),
             _call(5, resumed, "<answer>Aba Rell</answer>")]
    assert calls[4].prompt_ids == calls[2].prompt_ids
    rw = RewardRecord(rollout_id="r", reward=1.0, ground_truth="Aba Rell", answer="Aba Rell")
    t = reconstruct_rollout(calls, rw, RULES, rollout_id="r")
    assert t.meta["retries_dropped"] == []
    assert [(s.kind, s.parent) for s in t.sessions] == [("main", None), ("compaction", 0), ("main", 1),
                                                        ("compaction", 2), ("main", 3)]
    assert t.sessions[-1].is_final and t.answer == "Aba Rell"
    assert all(s.state_after is not None for s in t.sessions if s.kind == "compaction")
    # a re-send before anything went on from the earlier call is still a retry: the unused one goes
    partial = TOK("<tool_call>{", add_special_tokens=False)["input_ids"]
    again = replace(calls[2], call_id="again", seq=6, t_start=2.8, t_end=2.9, completion_ids=partial,
                    logprobs=[-0.1] * len(partial), text="<tool_call>{", finish_reason="length")
    t = reconstruct_rollout(calls[:3] + [again] + calls[3:], rw, RULES, rollout_id="r")
    assert len(t.meta["retries_dropped"]) == 1 and len(t.sessions) == 5


def test_a_new_start_after_a_used_duplicate_is_kept():
    """Rule 2's runs: a call built on an earlier member of a group of identical prompts (not only the last)
    makes a later identical call a new start, kept."""
    from mosaic.capture.reconstruct import dedup_retries

    head = [SYSTEM, ASK]
    search = '<tool_call>{"name": "search", "arguments": {"query": "Nidal Works"}}</tool_call>'
    said = {"role": "assistant", "content": search}
    a = _call(1, head, search)
    partial = TOK("<tool_call>{", add_special_tokens=False)["input_ids"]
    a2 = replace(a, call_id="c2", seq=2, t_start=1.2, completion_ids=partial, logprobs=[-0.1] * len(partial),
                 text="<tool_call>{", finish_reason="length")  # a parallel duplicate nothing used
    c = _call(3, head + [said, {"role": "tool", "content": "Nidal Works: an engine maker."}], "<answer>x</answer>")
    a3 = replace(_call(4, head, "<answer>Aba Rell</answer>"), call_id="c4")  # the same prompt, sent after c
    kept, dropped = dedup_retries([a, a2, c, a3], RULES)
    assert dropped == ["c2"] and [k.call_id for k in kept] == ["c1", "c3", "c4"]


def test_message_match_off_leaves_a_re_rendered_compaction_to_rule_5d():
    calls, rw = _rollout("search")
    calls[0] = _resampled(calls[0], calls[0].text.index("Works") + 2)
    t = reconstruct_rollout(calls, rw, replace(RULES, message_match=False), rollout_id="r")
    comp = t.sessions[1]
    assert comp.kind == "compaction" and comp.meta.get("parent_by") != "messages"
