"""Exact token records and session graphs of the harness (docs/algorithm.md §1, §2, §4.4)."""

from collections import Counter

import pytest

from mosaic.agent.chat import ChatFormat
from mosaic.agent.expert import ExpertNoise, ExpertPolicy
from mosaic.agent.harness import MODES, DeepSearchEnv, Harness, HarnessConfig
from _doubles import RecordingPolicy
from mosaic.agent.models.corpus import build_project_tokenizer
from mosaic.envs.deepsearch import load_split
from mosaic.trace import JsonlWriter, read_jsonl, to_rows, turn_boundaries


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return load_split("validation", preset="cpu", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def chat(split):
    return ChatFormat(build_project_tokenizer([split]))


def rollout(split, chat, mode, *, noise=None, n=16, group=2, last=False, **cfg):
    policy = RecordingPolicy(ExpertPolicy(chat.tokenizer, split.tasks, noise or ExpertNoise(
        wrong_query=0.2, redundant_search=0.2, early_guess=0.05, lossy_summary=0.3, extra_session=0.3)))
    config = HarnessConfig(mode=mode, **{"context_budget": 400, "max_new_tokens": 64, **cfg})
    tasks = split.tasks[-n:] if last else split.tasks[:n]  # (tasks are ordered by hop count)
    trajs = Harness(policy, chat, DeepSearchEnv(split), config).run(tasks, group_size=group, seed=3)
    return trajs, policy


@pytest.mark.parametrize("mode", MODES)
def test_rows_reproduce_every_policy_input_exactly(split, chat, mode):
    trajs, policy = rollout(split, chat, mode)
    by_key = {f"{t.id}/{s.id}": (t, s) for t in trajs for s in t.sessions}
    rows = {(r.traj_index, r.session_index): r for r in to_rows(trajs)}
    index = {t.id: i for i, t in enumerate(trajs)}
    first_seen = set()
    sampled_total = 0
    for req, res in policy.calls:
        traj, s = by_key[req.session_key]
        row = rows[(index[traj.id], s.id)]
        n = len(req.prompt_ids)
        if req.session_key not in first_seen:  # a session's first request is its prompt, as fed
            first_seen.add(req.session_key)
            assert row.prompt_ids == req.prompt_ids
        full = row.input_ids
        assert full[:n] == req.prompt_ids
        k = len(res.token_ids)
        assert full[n:n + k] == res.token_ids  # sampled tokens follow the fed context verbatim
        off = n - len(row.prompt_ids)
        assert off >= 0
        assert row.loss_mask[off:off + k] == [True] * k
        assert row.logprobs[off:off + k] == res.logprobs
        sampled_total += k
    assert first_seen == set(by_key)  # every session was fed at least once
    # loss_mask is True exactly on sampled tokens
    assert sum(r.num_trainable for r in rows.values()) == sampled_total
    assert sampled_total == sum(t.meta["tokens_sampled"] for t in trajs)
    inserted = sum(len(r.completion_ids) - r.num_trainable for r in rows.values())
    assert inserted == sum(t.meta["tokens_inserted"] for t in trajs)
    for r in rows.values():
        assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.loss_mask) if not m)
    # every session was released exactly once
    assert sorted(policy.released) == sorted(by_key)


@pytest.mark.parametrize("mode", MODES)
def test_every_state_ends_at_a_message_boundary(split, chat, mode):
    trajs, _ = rollout(split, chat, mode)
    boundary = [chat.im_end_id] + chat.newline_ids
    for t in trajs:
        for s in t.sessions:
            for ref in (s.state_before, s.state_after):
                assert ref is not None, (t.id, s.id, s.kind)
                toks = t.resolve_state(ref)
                assert toks[-len(boundary):] == boundary, (t.id, s.id, s.kind, chat.decode(toks[-12:]))
            # turn-level probe points: increasing, at boundaries, from the prompt to the session's end
            bounds = turn_boundaries(s, chat.generation_header_ids)
            assert bounds == sorted(set(bounds)) and len(bounds) >= 1
            full = s.tokens()
            for b in bounds:
                assert full[:b][-len(boundary):] == boundary
            if s.kind == "main":
                assert bounds[0] == s.state_before.upto and len(bounds) == s.num_turns + 1
                assert t.state_key(s.state_after)[2] == bounds[-1]


def test_compaction_graph_and_shared_states(split, chat):
    trajs, _ = rollout(split, chat, "compaction", noise=ExpertNoise.off(), context_budget=300)
    compacted = [t for t in trajs if t.meta["compactions"] > 0]
    assert len(compacted) >= len(trajs) // 2
    for t in compacted:
        kinds = [s.kind for s in t.sessions]
        assert kinds == ["main", "compaction"] * t.meta["compactions"] + ["main"]
        for k, s in enumerate(t.sessions):
            assert s.parent == (None if k == 0 else k - 1)
            assert s.edge == (None if k == 0 else "continues")
            assert s.is_final == (k == len(t.sessions) - 1)
        for k in range(1, len(t.sessions), 2):
            prev, comp, nxt = t.sessions[k - 1], t.sessions[k], t.sessions[k + 1]
            assert prev.end_reason == "compaction" and comp.end_reason == "summary"
            assert t.state_key(comp.state_before) == t.state_key(prev.state_after)
            assert t.state_key(comp.state_after) == t.state_key(nxt.state_before)
            # the compaction prompt is the whole previous context + the instruction
            assert comp.prompt_ids[: len(prev.tokens())] == prev.tokens()
            summary = chat.decode([i for i, m in zip(comp.completion_ids, comp.loss_mask) if m])
            summary = summary.replace("<|im_end|>", "").strip()
            assert summary in chat.decode(nxt.prompt_ids)
        # shared states are one key: k compactions need 2k + 1 probes (docs/algorithm.md §4.4)
        keys = {t.state_key(r) for s in t.sessions[:-1] for r in (s.state_before, s.state_after)}
        assert len(keys) == 2 * t.meta["compactions"] + 1
    assert all(t.success for t in trajs)


def test_fork_graph_and_merge_states(split, chat):
    trajs, _ = rollout(split, chat, "fork", noise=ExpertNoise.off(), context_budget=1024)
    for t in trajs:
        assert t.meta["forks"] >= 1
        main = t.sessions[0]
        assert main.kind == "main" and main.is_final
        subs = [s for s in t.sessions if s.kind == "subagent"]
        assert len(subs) == t.meta["forks"] == t.meta["tool_calls"]["delegate"]
        full = main.tokens()
        for sub in subs:
            assert sub.parent == 0 and sub.edge == "forks" and sub.end_reason == "answer"
            a, b = sub.state_before.upto, sub.state_after.upto
            assert sub.state_before.session == sub.state_after.session == 0 and a < b
            between = chat.decode(full[a:b])
            # exactly one assistant turn (the delegate call) and its tool response in between
            assert between.startswith("<|im_start|>assistant\n<tool_call>")
            assert between.count("<|im_start|>") == 2 and '"delegate"' in between
            answer = chat.decode([i for i, m in zip(sub.completion_ids, sub.loss_mask) if m])
            answer = answer.split("<answer>")[1].split("</answer>")[0]
            assert between.endswith(f"<tool_response>\n{answer}\n</tool_response><|im_end|>\n")
        assert t.success


def test_compaction_plus_fork_graph(split, chat):
    trajs, _ = rollout(split, chat, "compaction+fork", noise=ExpertNoise.off(), context_budget=370, last=True)
    assert any(t.meta["compactions"] for t in trajs) and all(t.meta["forks"] for t in trajs)
    for t in trajs:
        mains = [s for s in t.sessions if s.kind == "main"]
        assert mains[-1].is_final and sum(s.is_final for s in t.sessions) == 1
        for s in t.sessions:
            parent = None if s.parent is None else t.sessions[s.parent]
            if s.kind == "subagent":
                assert parent.kind == "main" and s.edge == "forks"
                assert s.state_before.session == s.state_after.session == parent.id
            elif s.kind == "compaction":
                assert parent.kind == "main" and s.edge == "continues" and parent.end_reason == "compaction"
                assert t.state_key(s.state_before) == t.state_key(parent.state_after)
            else:
                assert s.parent is None or (parent.kind == "compaction" and s.edge == "continues")
                if parent is not None:
                    assert t.state_key(parent.state_after) == t.state_key(s.state_before)
        assert t.success


def test_ids_groups_ground_truth_and_streaming(split, chat, tmp_path):
    tasks = split.tasks[:5]
    policy = ExpertPolicy(chat.tokenizer, tasks, ExpertNoise.off())
    harness = Harness(policy, chat, DeepSearchEnv(split), HarnessConfig(mode="compaction", context_budget=400))
    path = tmp_path / "out.jsonl"
    seen = []
    with JsonlWriter(path) as w:
        def cb(traj):
            seen.append(traj.id)
            w.write(traj)
        trajs = harness.run(tasks, group_size=3, seed=0, on_trajectory=cb, step=7)
    assert len({t.id for t in trajs}) == 15 and sorted(seen) == sorted(t.id for t in trajs)
    assert Counter(t.group_id for t in trajs) == {f"7/{t.id}": 3 for t in tasks}
    for t in trajs:
        task = next(x for x in tasks if x.id == t.task_id)
        assert t.ground_truth == task.answer and t.reward == 1.0 and t.success
        for key in ("invalid_actions", "tool_calls", "compactions", "forks", "tokens_sampled", "tokens_inserted"):
            assert key in t.meta
    back = read_jsonl(path)
    assert [t.to_dict() for t in back] == [t.to_dict() for t in sorted(trajs, key=lambda t: seen.index(t.id))]


def test_one_batched_call_per_step(split, chat):
    trajs, policy = rollout(split, chat, "fork", noise=ExpertNoise.off(), n=8, group=4, context_budget=1024)
    assert policy.batches[0] == 32  # every trajectory's first turn in one call
    assert max(policy.batches) == 32
    # a step never holds two requests of the same trajectory (sessions run one at a time)
    start = 0
    for size in policy.batches:
        keys = [req.session_key.rsplit("/", 1)[0] for req, _ in policy.calls[start:start + size]]
        assert len(keys) == len(set(keys))
        start += size
    assert start == len(policy.calls)
