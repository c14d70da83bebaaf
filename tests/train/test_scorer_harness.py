"""The gain scorer on real harness rollouts (scripted expert, compaction + forks, project tokenizer)."""

import pytest
import torch

from mosaic.trace import flatten
from mosaic.train.scorer import score_gains, score_reference

from .conftest import tiny_model


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    from mosaic.agent.chat import ChatFormat
    from mosaic.agent.expert import ExpertNoise, ExpertPolicy
    from mosaic.agent.harness import DeepSearchEnv, Harness, HarnessConfig
    from mosaic.agent.models.corpus import build_project_tokenizer
    from mosaic.envs.deepsearch import load_split

    split = load_split("validation", preset="cpu", cache_dir=tmp_path_factory.mktemp("cache"))
    chat = ChatFormat(build_project_tokenizer([split]))
    policy = ExpertPolicy(chat.tokenizer, split.tasks[:3], ExpertNoise(), seed=0)
    harness = Harness(policy, chat, DeepSearchEnv(split),
                      HarnessConfig(mode="compaction+fork", context_budget=390, max_new_tokens=64))
    return chat, harness.run(split.tasks[:3], group_size=2, seed=0)


def test_scorer_matches_reference_on_harness_rollouts(rollouts):
    chat, trajs = rollouts
    assert any(t.meta["compactions"] > 0 for t in trajs) and any(t.meta["forks"] > 0 for t in trajs)
    model = tiny_model(vocab_size=len(chat.tokenizer), seed=2)
    fast = score_gains(trajs, model, chat.answer_probe, return_logprobs=True)
    ref = score_reference(trajs, model, chat.answer_probe)
    torch.testing.assert_close(fast.gains, ref.gains, atol=1e-4, rtol=0)
    fb = flatten(trajs)
    assert torch.equal(fast.is_final, torch.as_tensor(fb.is_final))
    assert len(fast.old_logprobs) == len(fb.kinds)
    # Dedupe: a chain of k compactions shares its boundary states (2k + 1 probes for the chain).
    assert fast.stats.num_unique_states < fast.stats.num_state_refs
    # Every probed state ends at a message boundary (the probe is appended as a new message).
    end = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for t in trajs:
        for s in t.sessions:
            if s.is_final:
                continue
            for ref_ in (s.state_before, s.state_after):
                toks = t.resolve_state(ref_)
                tail = chat.tokenizer.decode(toks[-3:])
                assert end in toks[-2:], (t.id, s.id, s.kind, repr(tail))


def test_turn_states_end_at_message_boundaries(rollouts):
    from mosaic.trace import turn_boundaries
    from mosaic.train.scorer import score_turns

    chat, trajs = rollouts
    tok = chat.tokenizer
    nl_end = chat.encode("<|im_end|>\n")
    n_cuts = 0
    for t in trajs:
        for s in t.sessions:
            toks = s.tokens()
            raw = turn_boundaries(s)
            cuts = turn_boundaries(s, chat.generation_header_ids)
            assert len(cuts) == len(raw) == 1 + s.num_turns
            for c in cuts:
                assert toks[c - len(nl_end) : c] == nl_end, tok.decode(toks[c - 8 : c])
                n_cuts += 1
    assert n_cuts > 2 * len(trajs)
    model = tiny_model(vocab_size=len(tok), seed=3)
    few = trajs[:2]
    a = score_turns(few, model, chat.answer_probe, method="cached", header_ids=chat.generation_header_ids)
    b = score_turns(few, model, chat.answer_probe, method="reference", header_ids=chat.generation_header_ids)
    for x, y in zip(a.loglik, b.loglik):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=0)
