"""The scripted expert: solve rates with noise off, observed noise rates, noise effects."""

import math
from collections import Counter

import pytest

from mosaic.agent.chat import ChatFormat
from mosaic.agent.expert import NOISE_KINDS, ExpertNoise, ExpertPolicy
from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig
from mosaic.agent.models.corpus import build_project_tokenizer
from mosaic.envs.deepsearch import load_split


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def splits(cache):
    return {s: load_split(s, preset="cpu", cache_dir=cache) for s in ("train", "validation")}


@pytest.fixture(scope="module")
def chat(splits):
    return ChatFormat(build_project_tokenizer(list(splits.values())))


def solve(split, chat, mode, noise, *, group=1, seed=0, **cfg):
    policy = ExpertPolicy(chat.tokenizer, split.tasks, noise, seed=seed)
    return Harness(policy, chat, DeepSearchEnv(split), HarnessConfig(mode=mode, **cfg)).run(
        split.tasks, group_size=group, seed=seed)


@pytest.mark.parametrize("mode, budget", [("compaction", 360), ("fork", 1024), ("compaction+fork", 390)])
def test_noise_off_solves_validation(splits, chat, mode, budget):
    trajs = solve(splits["validation"], chat, mode, ExpertNoise.off(), context_budget=budget, max_new_tokens=64)
    rate = sum(t.success for t in trajs) / len(trajs)
    assert rate >= 0.99, (mode, rate, Counter(t.end_reason for t in trajs))
    if "compaction" in mode:
        assert sum(t.meta["compactions"] > 0 for t in trajs) > len(trajs) / 3  # the budget bites
    if "fork" in mode:
        assert all(t.meta["forks"] == t.meta["hops"] for t in trajs)  # one subagent per hop
    assert all(t.meta["num_invalid"] == 0 for t in trajs)


def noise_counts(trajs):
    occ, opp = Counter(), Counter()
    for t in trajs:
        for k, (a, b) in t.meta["policy"]["noise"].items():
            occ[k] += a
            opp[k] += b
    return occ, opp


@pytest.mark.parametrize("noise", [
    ExpertNoise(wrong_query=0.25, redundant_search=0.25, early_guess=0.1, lossy_summary=0.3, extra_session=0.3),
    ExpertNoise(),  # the defaults
])
def test_observed_noise_rates_match_settings(splits, chat, noise):
    occ, opp = Counter(), Counter()
    for mode, budget in (("compaction", 360), ("compaction", 300), ("fork", 1024)):
        o, p = noise_counts(solve(splits["train"], chat, mode, noise, group=2, context_budget=budget,
                                  max_new_tokens=64, max_sessions=20))
        occ += o
        opp += p
    for kind in NOISE_KINDS:
        rate, n = getattr(noise, kind), opp[kind]
        assert n >= 60, (kind, n)
        tol = 4 * math.sqrt(rate * (1 - rate) / n) + 1e-9  # ~4 sigma binomial tolerance
        assert abs(occ[kind] / n - rate) <= tol, (kind, occ[kind], n, rate)


def test_noise_has_consequences(splits, chat):
    noise = ExpertNoise(wrong_query=0.0, redundant_search=0.0, early_guess=0.0, lossy_summary=1.0, extra_session=0.0)
    lossy = solve(splits["validation"], chat, "compaction", noise, context_budget=360, max_new_tokens=64,
                  max_sessions=30)
    clean = solve(splits["validation"], chat, "compaction", ExpertNoise.off(), context_budget=360, max_new_tokens=64)
    # a lossy summary makes the next session redo the dropped hop
    assert sum(t.meta["tool_calls"].get("search", 0) for t in lossy) > sum(
        t.meta["tool_calls"].get("search", 0) for t in clean)
    guess = solve(splits["validation"], chat, "compaction", ExpertNoise.off().__class__(early_guess=1.0, wrong_query=0,
                  redundant_search=0, lossy_summary=0, extra_session=0), context_budget=2000, max_new_tokens=64)
    guessed = [t for t in guess if t.meta["policy"]["noise"]["early_guess"][0] == 1]
    assert len(guessed) > 0.8 * len(guess)  # (the rest saw every hop's target in their first search)
    assert all(t.reward == 0.0 and t.end_reason == "answer" for t in guessed)  # an intermediate entity
    wrong = solve(splits["validation"], chat, "single", ExpertNoise(wrong_query=0.5, redundant_search=0.0,
                  early_guess=0.0, lossy_summary=0.0, extra_session=0.0), context_budget=2000, max_new_tokens=64)
    assert sum(t.success for t in wrong) >= 0.99 * len(wrong)  # recovers: redoes the hop with the right query
    assert sum(t.meta["tool_calls"]["search"] for t in wrong) > sum(t.meta["hops"] for t in wrong)


def test_expert_is_deterministic(splits, chat):
    a = solve(splits["validation"], chat, "compaction", ExpertNoise(), group=2, seed=5, context_budget=360)
    b = solve(splits["validation"], chat, "compaction", ExpertNoise(), group=2, seed=5, context_budget=360)
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]


def test_noise_validation():
    with pytest.raises(ValueError, match="ExpertNoise.wrong_query"):
        ExpertNoise(wrong_query=1.5)


@pytest.mark.slow
@pytest.mark.parametrize("mode, budget", [("compaction", 512), ("fork", 1024), ("compaction+fork", 768)])
def test_noise_off_solves_paper_validation(cache, mode, budget):
    split = load_split("validation", preset="paper", cache_dir=cache)
    chat = ChatFormat(build_project_tokenizer([split]))
    trajs = solve(split, chat, mode, ExpertNoise.off(), context_budget=budget, max_new_tokens=64, max_sessions=20)
    rate = sum(t.success for t in trajs) / len(trajs)
    assert len(trajs) == 300 and rate >= 0.99, (mode, rate, Counter(t.end_reason for t in trajs))
