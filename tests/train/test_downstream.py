"""Downstream session credit (docs/algorithm.md §4.10) and group references (§4.11)."""

import pytest
import torch

from mosaic.trace import flatten
from mosaic.trace.graph import Session, StateRef, Trajectory, validate
from mosaic.train.downstream import (downstream_from_logprobs, final_state_cut, group_references, plan_downstream, propagate,
                                     score_downstream, with_references)
from mosaic.train.scorer import score_gains

from .conftest import tiny_model


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    """Scripted-expert rollouts with forks and compactions, and with forks only (project tokenizer)."""
    from mosaic.agent.chat import ChatFormat
    from mosaic.agent.expert import ExpertNoise, ExpertPolicy
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig
    from mosaic.agent.models.corpus import build_project_tokenizer
    from mosaic.envs.deepsearch import load_split

    split = load_split("validation", preset="cpu", cache_dir=tmp_path_factory.mktemp("cache"))
    chat = ChatFormat(build_project_tokenizer([split]))
    out = {}
    for mode, budget in (("compaction+fork", 390), ("fork", 2048)):
        policy = ExpertPolicy(chat.tokenizer, split.tasks[:4], ExpertNoise(), seed=0)
        harness = Harness(policy, chat, DeepSearchEnv(split),
                          HarnessConfig(mode=mode, context_budget=budget, max_new_tokens=64))
        out[mode] = harness.run(split.tasks[:4], group_size=2, seed=0)
    return chat, split, out


def test_harness_records_where_each_result_lies(forks):
    chat, _, out = forks
    n = 0
    for t in out["fork"] + out["compaction+fork"]:
        for s in t.sessions:
            if s.kind != "subagent" or "merged_at" not in s.meta:
                continue
            a, b = s.meta["merged_at"]
            parent = t.sessions[s.parent].tokens()
            assert s.state_after.session == s.parent and s.state_after.upto == b
            # the span is exactly one tool message: it opens as tool_delta renders one, and ends the message
            empty = chat.tool_delta("")
            assert parent[a : a + 3] == empty[:3] and parent[b - 2 : b] == empty[-2:]
            n += 1
    assert n >= 4


def _cached_and_reference(chat, trajs, *, seed):
    """Downstream credit of ``trajs`` on a tiny random model, cached and reference paths (held equal here)."""
    model = tiny_model(vocab_size=len(chat.tokenizer), seed=seed)
    g = score_gains(trajs, model, chat.answer_probe).gains
    kw = dict(empty_result_ids=chat.tool_delta(""), header_ids=chat.generation_header_ids)
    fast = score_downstream(trajs, model, chat.answer_probe, g, **kw)
    ref = score_downstream(trajs, model, chat.answer_probe, g, method="reference", **kw)
    torch.testing.assert_close(fast.downstream, ref.downstream, atol=1e-4, rtol=0)
    return fast, ref


def test_cached_matches_reference_and_is_direct_under_forks(forks):
    chat, _, out = forks
    trajs = out["fork"]
    fast, ref = _cached_and_reference(chat, trajs, seed=5)
    assert fast.how == ref.how
    fb = flatten(trajs)
    sub = [h for h, k in zip(fast.how, fb.kinds.tolist()) if k == 2]
    assert sub and all(h in ("direct", "none") for h in sub)  # forks only: every merged result is in the final state
    assert "direct" in sub and fast.metrics["dag/subagent_result_in_final_share"] > 0
    assert all(h == "final" for h, f in zip(fast.how, fb.is_final.tolist()) if f)
    assert float(fast.downstream[torch.as_tensor(fb.is_final)].abs().sum()) == 0.0
    assert fast.metrics["dag/probes"] == ref.metrics["dag/probes"]
    # the cached path re-encodes only each ablation's tail, not the whole final state again
    assert fast.stats.tokens_encoded < ref.stats.tokens_encoded


def test_a_trajectory_without_a_reference_is_counted_apart_not_as_a_cut_off_helper(forks):
    """Under ``algo.gain_reference=group`` a group without a success has no target: its sessions are not
    probed, ``how`` says ``no_reference`` (not ``none``, a helper cut off with its trajectory), and the share of
    helpers' results in the final state counts only the probed trajectories' helpers."""
    import copy

    chat, _, out = forks
    trajs = [copy.copy(t) for t in out["fork"]]
    probed = score_downstream(trajs, tiny_model(vocab_size=len(chat.tokenizer), seed=5), chat.answer_probe,
                              [0.0] * sum(len(t.sessions) for t in trajs), empty_result_ids=chat.tool_delta(""),
                              header_ids=chat.generation_header_ids)  # fmt: skip
    trajs[0].ground_truth = None
    res = score_downstream(trajs, tiny_model(vocab_size=len(chat.tokenizer), seed=5), chat.answer_probe,
                           [0.0] * sum(len(t.sessions) for t in trajs), empty_result_ids=chat.tool_delta(""),
                           header_ids=chat.generation_header_ids)  # fmt: skip
    n0 = len(trajs[0].sessions)
    assert res.how[:n0] == ["final" if s.is_final else "no_reference" for s in trajs[0].sessions]
    assert res.metrics["dag/no_reference"] == sum(h == "no_reference" for h in res.how) >= 1
    assert res.metrics["dag/none"] == probed.metrics["dag/none"] - sum(h == "none" for h in probed.how[:n0])
    assert float(res.downstream[:n0].abs().sum()) == 0.0
    sub = [h for h, s in zip(res.how, (s for t in trajs for s in t.sessions)) if s.kind == "subagent"
           and h != "no_reference"]  # fmt: skip
    if sub:
        assert res.metrics["dag/subagent_result_in_final_share"] == sum(h == "direct" for h in sub) / len(sub)


def test_compaction_chain_propagates_and_matches_reference(forks):
    chat, _, out = forks
    trajs = [t for t in out["compaction+fork"] if t.meta["compactions"] > 0]
    assert trajs
    fast, ref = _cached_and_reference(chat, trajs, seed=6)
    assert "propagated" in fast.how  # sessions before the last compaction reach the answer through it
    # the last compaction before the final session is ablated directly (summary -> bare task)
    fb = flatten(trajs)
    kinds = fb.kinds.tolist()
    assert any(h == "direct" and k == 1 for h, k in zip(fast.how, kinds))


def _traj(sessions, end="answer"):
    t = Trajectory(id="t", task_id="q", group_id="g", sessions=sessions, reward=1.0, success=True,
                   answer="x", ground_truth="x", end_reason=end)
    return validate(t)


def _s(i, kind, parent=None, edge=None, final=False, n=10, **meta):
    s = Session(id=i, kind=kind, prompt_ids=list(range(1, n + 1)), completion_ids=[7, 8, 9, 10],
                loss_mask=[True, True, False, False], logprobs=[0.0] * 4, parent=parent, edge=edge,
                is_final=final, meta=dict(meta), num_turns=1)
    s.state_before = StateRef(session=i, upto=n)
    s.state_after = StateRef(session=i, upto=None)
    return s


def test_propagation_shares_follow_positive_gains_and_conserve_credit():
    # main0 -> compaction1 -> main2 (forks 3, 4, its result merged) -> compaction5 -> main6 (final)
    ss = [_s(0, "main"), _s(1, "compaction", 0, "continues"), _s(2, "main", 1, "continues"),
          _s(3, "subagent", 2, "forks", merged_at=[10, 12]), _s(4, "subagent", 2, "forks", merged_at=[12, 14]),
          _s(5, "compaction", 2, "continues"), _s(6, "main", 5, "continues", final=True)]
    t = _traj(ss)
    plan = plan_downstream(t, [99], None)
    assert plan.consumer == {0: 1, 1: 2, 2: 5, 3: 2, 4: 2}
    assert [a.session for a in plan.ablations] == [5]
    gains = [0.5, 0.2, 0.3, 0.6, -0.1, 0.0, 0.0]
    d = propagate(plan, {5: 2.0}, gains, 7)
    assert d[5] == 2.0 and d[2] == 2.0 and d[6] == 0.0
    # main2's inputs are compaction1 (g 0.2), sub3 (0.6), sub4 (-0.1 -> 0): shares 0.25, 0.75, 0
    assert d[1] == pytest.approx(0.5) and d[3] == pytest.approx(1.5) and d[4] == 0.0
    assert d[1] + d[3] + d[4] == pytest.approx(d[2])  # conserved along the edges into main2
    assert d[0] == pytest.approx(0.5)  # compaction1's only input
    # no positive gain among the inputs: equal shares
    d0 = propagate(plan, {5: 3.0}, [0.0] * 7, 7)
    assert d0[1] == d0[3] == d0[4] == pytest.approx(1.0)
    # blame (a negative consumer credit) goes to the inputs that lowered the likelihood, not the helpful ones
    dn = propagate(plan, {5: -2.0}, gains, 7)
    assert dn[4] == pytest.approx(-2.0) and dn[1] == 0.0 and dn[3] == 0.0  # sub4 alone had g < 0
    assert dn[1] + dn[3] + dn[4] == pytest.approx(dn[2])


def test_final_state_is_before_the_answer_turn():
    s = _s(0, "main", final=True)
    s.completion_ids = [7, 8, 9, 10, 11, 12]
    s.loss_mask = [True, True, False, False, True, True]
    s.logprobs = [0.0] * 6
    t = _traj([s])
    assert final_state_cut(t) == 10 + 4
    t.end_reason = "turn_cap"
    assert final_state_cut(t) == 16


def test_missing_span_and_aborted_helpers_are_counted_not_guessed():
    ss = [_s(0, "main", final=True), _s(1, "subagent", 0, "forks"), _s(2, "subagent", 0, "forks")]
    ss[2].end_reason = "aborted"
    t = _traj(ss)
    plan = plan_downstream(t, [99], None)
    assert plan.missing == [1] and not plan.ablations and 2 not in plan.consumer


def test_group_reference_is_the_most_frequent_successful_answer():
    def t(i, g, ok, ans):
        return Trajectory(id=str(i), task_id=g, group_id=g, sessions=[_s(0, "main", final=True)],
                          reward=float(ok), success=ok, answer=ans, ground_truth="gold")
    trajs = [t(0, "a", True, "Kelpin"), t(1, "a", False, "Oslo"), t(2, "a", True, "Velmora"),
             t(3, "a", True, "Velmora"), t(4, "b", False, "x"), t(5, "b", False, None), t(6, "c", True, "z"),
             t(7, "c", True, "y")]
    refs = group_references(trajs)
    assert refs == {"a": "Velmora", "b": None, "c": "z"}  # ties: the first in batch order
    # answers that agree after the reward's normalisation are one answer (the first spelling is kept)
    assert group_references([t(0, "d", True, "Lyon"), t(1, "d", True, "Paris"), t(2, "d", True, "the paris.")]) \
        == {"d": "Paris"}
    out = with_references(trajs, refs)
    assert [x.ground_truth for x in out] == ["Velmora"] * 4 + [None, None, "z", "z"]
    assert trajs[0].ground_truth == "gold" and out[0].sessions is trajs[0].sessions


def test_helpers_results_carry_downstream_credit_on_the_trained_policy(tmp_path):
    """On the shipped base model, replacing a scripted helper's (correct) result by an empty one lowers the
    final state's answer likelihood. Measured: 32 validation tasks, 70 helpers, mean D +2.98 nats, 76 %
    positive (immediate gains: 56 % positive; rank correlation with D 0.73); bounds leave room."""
    from mosaic.agent.expert import ExpertNoise, ExpertPolicy
    from mosaic.agent.harness import DeepSearchEnv, Harness
    from mosaic.config.loader import load_config
    from mosaic.train import setup
    from mosaic.train.pretrain import base_model_dir

    cfg = load_config("cpu", overrides=[f"data.cache_dir={tmp_path}", "harness.mode=fork"])
    model, tok = setup.load_policy(base_model_dir(cfg.model.embedded_preset), device=torch.device("cpu"),
                                   dtype=torch.float32)
    chat = setup.chat_format(tok)
    split = setup.load_split(cfg, "validation")
    tasks = split.tasks[:32]
    trajs = Harness(ExpertPolicy(tok, tasks, ExpertNoise(), seed=0), chat, DeepSearchEnv(split),
                    cfg.harness).run(tasks, 1, seed=0, progress=False)
    g = score_gains(trajs, model, chat.answer_probe).gains
    r = score_downstream(trajs, model, chat.answer_probe, g, empty_result_ids=chat.tool_delta(""),
                         header_ids=chat.generation_header_ids)
    sub = torch.as_tensor(flatten(trajs).kinds == 2)
    d = r.downstream[sub]
    assert d.numel() >= 30 and float(d.mean()) > 1.0 and float((d > 0).float().mean()) >= 0.6, d


def test_the_verl_loops_server_path_gives_the_same_credit(forks):
    """``downstream_from_logprobs`` (the verl agent loop: prompt log-probs from the rollout server) equals
    the trainer's scorer on the same trajectories and weights."""
    import asyncio

    chat, _, out = forks
    trajs = out["fork"][:4] + [t for t in out["compaction+fork"] if t.meta["compactions"] > 0][:2]
    model = tiny_model(vocab_size=len(chat.tokenizer), seed=7)
    g = score_gains(trajs, model, chat.answer_probe).gains
    kw = dict(empty_result_ids=chat.tool_delta(""), header_ids=chat.generation_header_ids)
    want = score_downstream(trajs, model, chat.answer_probe, g, method="reference", **kw).downstream

    async def logprobs(ids):  # what a server's prompt_logprobs return: token 0 gets 0
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        return [0.0] + lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()

    got, off = [], 0
    for t in trajs:
        n = len(t.sessions)
        got += asyncio.run(downstream_from_logprobs(t, chat.answer_probe(t.ground_truth), logprobs,
                                                    g[off : off + n].tolist(), **kw))
        off += n
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, atol=1e-4, rtol=0)


def test_own_states_keep_the_fork_point_and_cut_off_helpers_are_none(forks, tmp_path):
    """Review findings: with ``subagent_states=own`` the samples still say where a helper left its parent,
    and a helper cut off with the trajectory is ``none`` (its result never merged), not ``missing``."""
    from mosaic.agent.expert import ExpertNoise, ExpertPolicy
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig

    chat, split, _ = forks
    policy = ExpertPolicy(chat.tokenizer, split.tasks[:6], ExpertNoise(), seed=0)
    trajs = Harness(policy, chat, DeepSearchEnv(split), HarnessConfig(
        mode="fork", context_budget=2048, max_new_tokens=64, subagent_states="own", max_total_turns=4,
    )).run(split.tasks[:6], 1, seed=0, progress=False)  # fmt: skip
    cut = [(t, s) for t in trajs for s in t.sessions if s.kind == "subagent" and s.meta.get("aborted")]
    assert cut and all("merged_at" not in s.meta for _, s in cut)
    for t, s in cut:
        assert s.id not in plan_downstream(t, [1]).missing
    from mosaic.train.samples import sample_records
    recs = sample_records(trajs, range(len(trajs)), step=1, estimator=None, advantages={}, unavailable={})
    forks_ = [s for r in recs for s in r["sessions"] if s["kind"] == "subagent"]
    assert forks_ and all(isinstance(s.get("fork_at"), int) for s in forks_)


def test_reset_roles_ablate_the_notes_not_the_role(forks):
    """Review finding: with ``reset_roles`` the final session's bare prompt keeps its own role (an empty
    workspace), so the ablation swaps the notes only."""
    from mosaic.agent.expert import ExpertNoise, ExpertPolicy
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig

    chat, split, _ = forks
    roles = ("You search and note.", "You read the notes and decide.")
    policy = ExpertPolicy(chat.tokenizer, split.tasks[:6], ExpertNoise(), seed=0)
    trajs = Harness(policy, chat, DeepSearchEnv(split), HarnessConfig(
        mode="reset", reset_k=2, max_new_tokens=64, max_sessions=12, reset_roles=roles)).run(
        split.tasks[:6], 1, seed=0, progress=False)  # fmt: skip
    seen = 0
    for t in trajs:
        fin = t.final_session()
        if fin.parent is None:
            continue
        plan = plan_downstream(t, chat.tool_delta(""), chat.generation_header_ids)
        (ab,) = [a for a in plan.ablations if t.sessions[a.session].kind == "reset"]
        bare = chat.decode(list(ab.replacement))
        assert f"Your role: {roles[fin.meta['role']]}" in bare and "(empty)" in bare
        assert list(ab.replacement) == t.states[fin.meta["bare_state"]]
        seen += 1
    assert seen >= 3
