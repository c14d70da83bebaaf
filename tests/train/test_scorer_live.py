"""Session gains scored off the rollout policy's live KV cache equal the reference scorer's (issue 14).

Two rollout sources: the scripted expert's turns fed through a real :class:`LocalPolicy` cache (so the
rollouts have compactions *and* subagent forks, and every cache the live scorer reads was built by the
policy's own prefill path, turn by turn), and plain sampling from the tiny random model (compactions)."""

import pytest
import torch

from mosaic.agent.policy import GenRequest
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.train.scorer import LiveScorer, score_gains, score_reference

from .conftest import tiny_model


class TeacherForcedLocal(LocalPolicy):
    """The expert chooses each turn; the local model encodes it into the session's cache exactly as if it
    had sampled it (prompt + turn minus its last token, through the prefix-cache prefill)."""

    def __init__(self, model, tokenizer, expert):
        super().__init__(model, tokenizer, LocalPolicyConfig(seed=0))
        self.expert = expert

    @torch.inference_mode()
    def generate(self, requests):
        outs = self.expert.generate(requests)
        self._check_weights()
        for req, res in zip(requests, outs):
            ids = list(req.prompt_ids) + list(res.token_ids[:-1])
            fed = GenRequest(req.session_key, ids + [0], 1)  # the prefill feeds all but the last id
            pre = self._lookup(fed)
            _, batch = self._prefill([fed], [pre])
            self._store(req.session_key, ids + [0], batch.kv_of(0))
            # drop the dummy last position: the cache holds exactly prompt + turn[:-1]
            entry = self._cache[req.session_key]
            entry.ids, entry.kv = ids, [(k[:, : len(ids)], v[:, : len(ids)]) for k, v in entry.kv]
            self._cached_tokens -= 1
        return outs


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from mosaic.agent.chat import ChatFormat
    from mosaic.agent.models.corpus import build_project_tokenizer
    from mosaic.envs.deepsearch import load_split

    split = load_split("validation", preset="cpu", cache_dir=tmp_path_factory.mktemp("cache"))
    return split, ChatFormat(build_project_tokenizer([split]))


def _live_vs_reference(trajs, scorer, model, chat):
    known = scorer.known(trajs)
    live = score_gains(trajs, model, chat.answer_probe, known=known)
    ref = score_reference(trajs, model, chat.answer_probe)
    torch.testing.assert_close(live.gains, ref.gains, atol=1e-4, rtol=0)
    torch.testing.assert_close(live.loglik_before, ref.loglik_before, atol=1e-4, rtol=0, equal_nan=True)
    torch.testing.assert_close(live.loglik_after, ref.loglik_after, atol=1e-4, rtol=0, equal_nan=True)
    return live


def test_live_gains_equal_reference_with_compactions_and_forks(world):
    from mosaic.agent.expert import ExpertNoise, ExpertPolicy
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig

    split, chat = world
    model = tiny_model(vocab_size=len(chat.tokenizer), seed=2)
    policy = TeacherForcedLocal(model, chat.tokenizer, ExpertPolicy(chat.tokenizer, split.tasks[:3], ExpertNoise(), seed=0))
    scorer = LiveScorer(policy, chat.answer_probe)
    harness = Harness(policy, chat, DeepSearchEnv(split),
                      HarnessConfig(mode="compaction+fork", context_budget=390, max_new_tokens=64), state_scorer=scorer)
    trajs = harness.run(split.tasks[:3], group_size=2, seed=0)
    assert any(t.meta["compactions"] > 0 for t in trajs) and any(t.meta["forks"] > 0 for t in trajs)
    live = _live_vs_reference(trajs, scorer, model, chat)
    # Every needed state was scored live (nothing left for the after-rollout pass) ...
    assert scorer.missed == 0 and live.stats.num_probes == 0
    assert scorer.stats.num_unique_states >= live.stats.num_state_refs // 2
    # ... running only the tails and the probes, far fewer tokens than re-encoding the states.
    full = score_gains(trajs, model, chat.answer_probe)
    assert scorer.stats.tokens_encoded < 0.5 * full.stats.tokens_encoded
    # The compaction turn took over its main session's cache (prefill from the cache, no miss).
    assert policy.cache_stats["hits"] > 0


def test_live_gains_equal_reference_on_sampled_rollouts(world):
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig

    split, chat = world
    model = tiny_model(vocab_size=len(chat.tokenizer), seed=5)
    policy = LocalPolicy(model, chat.tokenizer, LocalPolicyConfig(seed=1, temperature=1.0))
    scorer = LiveScorer(policy, chat.answer_probe)
    harness = Harness(policy, chat, DeepSearchEnv(split),
                      HarnessConfig(mode="compaction", context_budget=300, max_new_tokens=48, max_turns=6,
                                    summary_max_new_tokens=32), state_scorer=scorer)  # fmt: skip
    trajs = harness.run(split.tasks[:2], group_size=2, seed=0)
    assert sum(t.meta["compactions"] for t in trajs) > 0
    live = _live_vs_reference(trajs, scorer, model, chat)
    assert scorer.missed == 0 and live.stats.num_probes == 0


def test_missed_states_fall_back_to_the_cached_scorer(world):
    """A policy that keeps no cache: the live scorer misses everything, counts it, and the scorer after the
    rollout probes it all (same gains)."""
    from mosaic.agent.expert import ExpertNoise, ExpertPolicy
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig

    split, chat = world
    model = tiny_model(vocab_size=len(chat.tokenizer), seed=2)
    policy = TeacherForcedLocal(model, chat.tokenizer, ExpertPolicy(chat.tokenizer, split.tasks[:2], ExpertNoise(), seed=1))
    scorer = LiveScorer(policy, chat.answer_probe)
    orig = policy.cached_prefix
    calls = {"n": 0}

    def flaky(key):  # every other session's cache is gone (evicted)
        calls["n"] += 1
        return None if calls["n"] % 2 else orig(key)

    policy.cached_prefix = flaky
    harness = Harness(policy, chat, DeepSearchEnv(split),
                      HarnessConfig(mode="compaction", context_budget=390, max_new_tokens=64), state_scorer=scorer)
    trajs = harness.run(split.tasks[:2], group_size=2, seed=0)
    live = _live_vs_reference(trajs, scorer, model, chat)
    assert scorer.missed > 0 and live.stats.num_probes > 0
    assert scorer.metrics()["score/live_missed"] == scorer.missed


def test_live_gains_equal_reference_with_context_resets(world):
    """Reset mode (issue 30): each session's start is probed off its own cache as it closes; a session's
    after-state is the next one's start (one reference), scored when that one closes."""
    from mosaic.agent.expert import ExpertNoise, ExpertPolicy
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig

    split, chat = world
    model = tiny_model(vocab_size=len(chat.tokenizer), seed=3)
    policy = TeacherForcedLocal(model, chat.tokenizer, ExpertPolicy(chat.tokenizer, split.tasks[:3], ExpertNoise(), seed=0))
    scorer = LiveScorer(policy, chat.answer_probe)
    harness = Harness(policy, chat, DeepSearchEnv(split),
                      HarnessConfig(mode="reset", reset_k=2, max_new_tokens=64, max_sessions=12), state_scorer=scorer)
    trajs = harness.run(split.tasks[:3], group_size=2, seed=0)
    assert any(len(t.sessions) > 1 for t in trajs) and all(s.kind == "reset" for t in trajs for s in t.sessions)
    live = _live_vs_reference(trajs, scorer, model, chat)
    assert scorer.missed == 0 and live.stats.num_probes == 0


def test_subagents_own_states_are_their_own_start_and_end_and_scored_live(world):
    """Issue 32: ``harness.subagent_states=own`` (docs/algorithm.md §4.4, the paper's alternative) probes a helper's own prompt and
    its own end; the live scorer probes them off the helper's own cache as it closes."""
    from mosaic.agent.expert import ExpertNoise, ExpertPolicy
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig

    split, chat = world
    model = tiny_model(vocab_size=len(chat.tokenizer), seed=4)
    runs = {}
    for states in ("merge", "own"):
        policy = TeacherForcedLocal(model, chat.tokenizer,
                                    ExpertPolicy(chat.tokenizer, split.tasks[:3], ExpertNoise(), seed=0))
        scorer = LiveScorer(policy, chat.answer_probe)
        harness = Harness(policy, chat, DeepSearchEnv(split),
                          HarnessConfig(mode="fork", context_budget=2048, max_new_tokens=64, subagent_states=states),
                          state_scorer=scorer)  # fmt: skip
        trajs = harness.run(split.tasks[:3], group_size=2, seed=0)
        runs[states] = (trajs, _live_vs_reference(trajs, scorer, model, chat), scorer)
    (merge, g_merge, _), (own, g_own, sc) = runs["merge"], runs["own"]
    assert [t.to_dict()["sessions"][0]["completion_ids"] for t in merge] == \
        [t.to_dict()["sessions"][0]["completion_ids"] for t in own]  # same rollouts, other states
    n = 0
    for t in own:
        for s in t.sessions:
            if s.kind != "subagent":
                continue
            n += 1
            assert s.state_before.session == s.id and s.state_after.session == s.id
            assert s.state_before.upto < len(s.tokens()) and "merged_at" in s.meta
    assert n >= 3 and sc.missed == 0
    sub = torch.tensor([s.kind == "subagent" for t in own for s in t.sessions])
    assert not torch.allclose(g_own.gains[sub], g_merge.gains[sub])


def test_gains_scored_off_a_served_policys_cache_after_the_rollouts_equal_reference(world):
    """An external harness's rollouts (``known_from_cache``): states probed after the rollouts off the serving
    policy's content-keyed prefix cache give the reference gains, and most states are found there."""
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig
    from mosaic.train.served_scoring import known_from_cache

    split, chat = world
    model = tiny_model(vocab_size=len(chat.tokenizer), seed=5)
    served = LocalPolicy(model, chat.tokenizer, LocalPolicyConfig(seed=1, temperature=1.0, shared_prefix=True))
    served.release = lambda key: None  # a server's requests are never released: their caches stay until evicted
    harness = Harness(served, chat, DeepSearchEnv(split), HarnessConfig(mode="compaction", context_budget=300,
                                                                        max_new_tokens=48))
    trajs = harness.run(split.tasks[:4], group_size=2, seed=0)
    assert any(t.meta["compactions"] > 0 for t in trajs)
    known, stats, found = known_from_cache(trajs, served, chat.answer_probe)
    after = score_gains(trajs, model, chat.answer_probe, known=known)
    ref = score_reference(trajs, model, chat.answer_probe)
    torch.testing.assert_close(after.gains, ref.gains, atol=1e-4, rtol=0)
    assert found >= after.stats.num_state_refs // 2 > 0
    # the probes ran off the cache: far fewer tokens than encoding the states again
    assert stats.tokens_encoded < 0.5 * score_gains(trajs, model, chat.answer_probe).stats.tokens_encoded


def test_a_cache_that_holds_only_the_shared_prompt_is_not_used(world):
    """A small served cache (entries evicted, only the system prompt and question shared with what is left):
    no session is re-encoded one by one off it; the batched pass after scores them (same gains)."""
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig
    from mosaic.train.served_scoring import known_from_cache

    split, chat = world
    model = tiny_model(vocab_size=len(chat.tokenizer), seed=5)
    served = LocalPolicy(model, chat.tokenizer, LocalPolicyConfig(seed=1, temperature=1.0, shared_prefix=True,
                                                                 prefix_cache_tokens=400))
    served.release = lambda key: None
    harness = Harness(served, chat, DeepSearchEnv(split), HarnessConfig(mode="compaction", context_budget=300,
                                                                        max_new_tokens=48))
    trajs = harness.run(split.tasks[:4], group_size=2, seed=0)
    known, stats, found = known_from_cache(trajs, served, chat.answer_probe)
    full = score_gains(trajs, model, chat.answer_probe)
    assert stats.tokens_encoded <= 64 * len(trajs) * 4  # tails only, never whole sessions
    after = score_gains(trajs, model, chat.answer_probe, known=known)
    torch.testing.assert_close(after.gains, full.gains, atol=1e-4, rtol=0)
    assert found < full.stats.num_unique_states
