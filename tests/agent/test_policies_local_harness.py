"""LocalPolicy inside the real harness: multi-session rollouts (compaction; fork mode on),
prefix cache on vs off give identical greedy trajectories; sessions are released."""

from __future__ import annotations

import pytest

from mosaic.agent.chat import ChatFormat
from mosaic.agent.harness import Harness, HarnessConfig
from mosaic.agent.models.embedded import EmbeddedModelConfig, build_model
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from _doubles import FakeEnv, FakeTask, RecordingPolicy
from mosaic.agent.tokenizer import train_tokenizer
from mosaic.agent.models.corpus import prompt_texts

SEARCH = '<tool_call>{"name": "search", "arguments": {"query": "Ruo Ces works"}}</tool_call>'
TASKS = [FakeTask("t0", "Who is the founder of Ruo Ces?", "Ama Rell"), FakeTask("t1", "Where is Osk?", "Port Osk")]


@pytest.fixture(scope="module")
def chat_model():
    corpus = [SEARCH, "Doc about Ruo Ces works word word", "<answer>Ama Rell</answer>",
              *prompt_texts(HarnessConfig())] * 30
    tok = train_tokenizer(corpus, vocab_size=1024)
    model = build_model(EmbeddedModelConfig.preset("tiny", initializer_range=0.3), tok, seed=0)
    return ChatFormat(tok), model


def _run(chat, model, prefix_cache):
    policy = RecordingPolicy(LocalPolicy(model, chat.tokenizer,
                                         LocalPolicyConfig(temperature=0, prefix_cache=prefix_cache)))
    cfg = HarnessConfig(mode="compaction+fork", context_budget=400, max_new_tokens=16,
                        summary_max_new_tokens=16, max_turns=12, max_sessions=3, max_total_turns=6)
    trajs = Harness(policy, chat, FakeEnv(words_per_hit=2), cfg).run(TASKS, group_size=2, seed=0)
    return trajs, policy


def test_harness_rollouts_equal_with_and_without_prefix_cache(chat_model):
    chat, model = chat_model
    a, pa = _run(chat, model, True)
    b, _ = _run(chat, model, False)
    assert [[s.tokens() for s in t.sessions] for t in a] == [[s.tokens() for s in t.sessions] for t in b]
    for ta, tb in zip(a, b):
        for sa, sb in zip(ta.sessions, tb.sessions):
            assert sa.logprobs == pytest.approx(sb.logprobs, abs=1e-4)
    inner = pa.inner
    assert inner.cache_stats["hits"] > 0
    assert any(len(t.sessions) > 1 for t in a)  # a rewrite happened (compaction)
    assert not inner._cache  # every session was released at its end
