"""The harness with a real sampling model: records reproduce the model's inputs and log-probs.

A tiny untrained model (KV-cache ``LocalPolicy``) emits near-random turns; every training
row must equal what the model was fed, and a fresh full forward pass over each row must give
back the recorded sampling log-probs on the trainable tokens (temperature 1, top-p 1), i.e.
the cached incremental decoding and the stored sequence are the same sequence.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mosaic.agent.policies.local")

from mosaic.agent.chat import ChatFormat  # noqa: E402
from mosaic.agent.harness import Harness, HarnessConfig  # noqa: E402
from _tiny import tiny_model  # noqa: E402
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig  # noqa: E402
from _doubles import FakeEnv, FakeTask, RecordingPolicy  # noqa: E402
from mosaic.trace import to_rows  # noqa: E402


@pytest.mark.slow  # ~25 s alone on 2 cores, more on a loaded machine
def test_local_model_rows_and_logprobs():
    model, tok = tiny_model(seed=1)
    chat = ChatFormat(tok)
    policy = RecordingPolicy(LocalPolicy(model, tok, LocalPolicyConfig(temperature=1.0, seed=0)))
    cfg = HarnessConfig(mode="compaction+fork", context_budget=700, max_new_tokens=24, summary_max_new_tokens=24,
                        max_total_turns=6, max_sessions=6, system_prompt="Search. {tools}",
                        subagent_system_prompt="Help. {tools}", compaction_prompt="Summarise.")
    tasks = [FakeTask(f"t{i}", f"Who founded Meridian Works {i}?", "Karlen Duvas") for i in range(3)]
    trajs = Harness(policy, chat, FakeEnv(words_per_hit=1), cfg).run(tasks, group_size=2, seed=0)
    rows = {(t.id, s.id): r for t in trajs for s, r in zip(t.sessions, to_rows([t]))}
    assert len(policy.calls) >= 20
    for req, res in policy.calls:
        tid, sid = req.session_key.rsplit("/", 1)
        row = rows[(tid, int(sid))]
        n, k = len(req.prompt_ids), len(res.token_ids)
        assert row.input_ids[:n] == req.prompt_ids and row.input_ids[n:n + k] == res.token_ids
    model.eval()
    checked = 0
    with torch.no_grad():
        for row in rows.values():
            if not row.num_trainable:
                continue
            ids = torch.tensor([row.input_ids])
            logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]  # (L, V)
            p0 = len(row.prompt_ids)
            for j, (tok_id, m, lp) in enumerate(zip(row.completion_ids, row.loss_mask, row.logprobs)):
                if m:
                    assert logp[p0 + j - 1, tok_id].item() == pytest.approx(lp, abs=2e-3)
                    checked += 1
                else:
                    assert lp == 0.0
    assert checked == sum(t.meta["tokens_sampled"] for t in trajs) > 100
