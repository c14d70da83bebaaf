"""Property: random multi-session rollouts, randomly interleaved, rebuild to their true graph.

A generator plays a harness in token space (through the scripted renderer):
main turns with tool results, forks of 1-3 subagents whose calls interleave
in a random order, compactions that restart the main session from a summary,
and an optional retried call nobody used. Reconstruction must recover every
session's kind and parent, and drop exactly the retry.
"""

from __future__ import annotations

import functools
import json
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mosaic.capture.reconstruct import ReconstructionRules, reconstruct_rollout
from mosaic.capture.records import CallRecord
from mosaic.capture.scripted import Renderer, build_tokenizer, render_tool_calls


@functools.lru_cache(maxsize=1)
def _rnd() -> Renderer:
    return Renderer(build_tokenizer())


def _generate(rng: random.Random, retry: bool):
    rnd = _rnd()
    uid = iter(range(10**6))
    calls: list[dict] = []  # in arrival order: messages, text, tool_calls, truth session
    truth: list[dict] = [{"kind": "main", "parent": None}]

    def call(messages, text, tool_calls, sess):
        calls.append({"messages": json.loads(json.dumps(messages)), "text": text, "tool_calls": tool_calls,
                      "sess": sess})

    def tc(name, args):
        return {"id": f"id{next(uid)}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)}}

    system, task = {"role": "system", "content": "main agent"}, {"role": "user", "content": f"task {rng.random()}"}
    main, cur = [system, task], 0
    for _ in range(rng.randint(1, 5)):
        # A harness compacts a session that has made at least one turn.
        made_turn = any(c["sess"] == cur for c in calls)
        action = rng.choice(["tool", "fork", "compact"] if made_turn else ["tool", "fork"])
        if action == "tool":
            t = tc("ls", {"path": f"/{next(uid)}"})
            call(main, "", [t], cur)
            main = main + [{"role": "assistant", "content": "", "tool_calls": [t]},
                           {"role": "tool", "tool_call_id": t["id"], "content": f"files {next(uid)}"}]
        elif action == "fork":
            k = rng.randint(1, 3)
            forks = [tc("task", {"description": f"SUBTASK {next(uid)}"}) for _ in range(k)]
            call(main, "", forks, cur)
            # Each subagent's calls, in order; then a random merge of the k sequences.
            seqs, results = [], []
            for f in forks:
                sid = len(truth)
                truth.append({"kind": "subagent", "parent": cur})
                msgs = [{"role": "system", "content": "subagent"},
                        {"role": "user", "content": json.loads(f["function"]["arguments"])["description"]}]
                seq = []
                for _ in range(rng.randint(0, 2)):
                    t = tc("ls", {"path": f"/s{next(uid)}"})
                    seq.append((msgs, "", [t], sid))
                    msgs = msgs + [{"role": "assistant", "content": "", "tool_calls": [t]},
                                   {"role": "tool", "tool_call_id": t["id"], "content": f"sub files {next(uid)}"}]
                result = f"RESULT {next(uid)} {rng.random()}"
                seq.append((msgs, result, [], sid))
                seqs.append(seq)
                results.append(result)
            while any(seqs):
                s = rng.choice([q for q in seqs if q])
                call(*s.pop(0))
            main = main + [{"role": "assistant", "content": "", "tool_calls": forks}] + [
                {"role": "tool", "tool_call_id": f["id"], "content": r} for f, r in zip(forks, results)]
        else:
            comp = len(truth)
            truth.append({"kind": "compaction", "parent": cur})
            history = "\n".join(m.get("content") or "" for m in main)
            summary = f"SUMMARY {next(uid)} {rng.random()}"
            call([{"role": "user", "content": "Summarize the conversation. Messages to summarize:\n" + history}],
                 summary, [], comp)
            cur = len(truth)
            truth.append({"kind": "main", "parent": comp})
            main = [system, task, {"role": "user", "content": f"Here is a summary:\n\n{summary}"}]
            # A harness compacts right before a turn, so the new main session makes that turn.
            t = tc("ls", {"path": f"/{next(uid)}"})
            call(main, "", [t], cur)
            main = main + [{"role": "assistant", "content": "", "tool_calls": [t]},
                           {"role": "tool", "tool_call_id": t["id"], "content": f"files {next(uid)}"}]
    call(main, f"ANSWER {next(uid)}", [], cur)

    records = []
    for i, c in enumerate(calls):
        prompt = rnd.chat_prompt(c["messages"], None)
        comp_ids = rnd.completion(c["text"] + render_tool_calls(c["tool_calls"]))
        records.append(CallRecord(call_id=f"c{i}", rollout_id="p", seq=i, endpoint="chat", messages=c["messages"],
                                  prompt_ids=prompt, completion_ids=comp_ids, logprobs=[-0.1] * len(comp_ids),
                                  text=c["text"], tool_calls=c["tool_calls"],
                                  finish_reason="tool_calls" if c["tool_calls"] else "stop",
                                  t_start=float(i), t_end=i + 0.5))
    dropped = None
    if retry:
        j = rng.randrange(len(records))
        orig = records[j]
        extra = rnd.completion(f"RETRY {next(uid)} abandoned")
        dup = CallRecord(call_id="retry", rollout_id="p", seq=-1, endpoint="chat", messages=orig.messages,
                         prompt_ids=orig.prompt_ids, completion_ids=extra, logprobs=[-0.2] * len(extra),
                         text="RETRY abandoned attempt", finish_reason="stop", t_start=orig.t_start - 0.25,
                         t_end=orig.t_start - 0.2)
        records.append(dup)
        dropped = "retry"
    return records, [c["sess"] for c in calls], truth, dropped


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), retry=st.booleans(), patterns=st.booleans())
def test_random_interleavings_rebuild_the_true_graph(seed, retry, patterns):
    rng = random.Random(seed)
    records, call_truth, truth, dropped = _generate(rng, retry)
    rules = ReconstructionRules() if patterns else ReconstructionRules(compaction_patterns=())
    t = reconstruct_rollout(list(reversed(records)), rules=rules)
    assert t.meta["retries_dropped"] == ([dropped] if dropped else [])
    truth_of = {f"c{i}": s for i, s in enumerate(call_truth)}
    # Map each rebuilt session to the true session of its calls (all its calls must agree).
    mapped = []
    for s in t.sessions:
        owners = {truth_of[c] for c in s.meta["call_ids"]}
        assert len(owners) == 1, (s.id, owners)
        mapped.append(owners.pop())
    assert sorted(mapped) == list(range(len(truth)))  # no session split or merged
    for s, true_id in zip(t.sessions, mapped):
        want = truth[true_id]
        assert s.kind == want["kind"]
        assert (mapped[s.parent] if s.parent is not None else None) == want["parent"]
    finals = [mapped[s.id] for s in t.sessions if s.is_final]
    assert finals == [max(i for i, x in enumerate(truth) if x["kind"] == "main")]
    assert sum(s.num_trainable for s in t.sessions) == sum(
        len(r.completion_ids) for r in records if r.call_id != dropped)
