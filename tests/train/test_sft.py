"""SFT warm start: expert rollouts through the harness, loss on sampled tokens only."""

from __future__ import annotations

import torch

from mosaic.train import setup
from mosaic.config.loader import load_config
from mosaic.train.sft import expert_trajectories, sft_train


def test_sft_on_expert_rollouts_learns_every_session_kind(tmp_path):
    cfg = load_config("cpu", overrides=[f"data.cache_dir={tmp_path / 'cache'}", "model.source=embedded", "sft.epochs=5", "sft.batch_size=4",
                                        "sft.warmup_steps=2", "harness.context_budget=300"])
    train = setup.load_split(cfg, "train")
    model, tok = setup.build_base_model(cfg, torch.device("cpu"), torch.float32)
    chat = setup.chat_format(tok)
    trajs = expert_trajectories(cfg, train, tok, chat, n_tasks=8, progress=False)
    kinds = {s.kind for t in trajs for s in t.sessions}
    assert {"main", "compaction"} <= kinds  # the budget forces compaction: summaries are trained too
    # Only sampled tokens carry loss: inserted (tool / template) tokens are masked out.
    resp = tok.convert_tokens_to_ids("<tool_response>")
    mains = [s for t in trajs for s in t.sessions if s.kind == "main"]
    assert any(sum(s.loss_mask) < len(s.completion_ids) for s in mains)
    assert not any(m for s in mains for i, m in zip(s.completion_ids, s.loss_mask) if i == resp)
    res = sft_train(model, trajs, cfg, pad_id=tok.pad_token_id, device=torch.device("cpu"), progress=False)
    assert res.steps > 5 and res.tokens == sum(s.num_trainable for t in trajs for s in t.sessions)
    first, last = sum(res.losses[:3]) / 3, sum(res.losses[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert not model.training  # handed back in eval mode for rollouts


def test_sft_data_with_ids_outside_the_vocabulary_is_left_out_or_refused(tmp_path, capsys):
    """Trajectories made with another tokenizer used to crash SFT in the embedding lookup after the
    model was built; now each is left out and counted, and a file of nothing else is one line, exit 2."""
    import random

    from mosaic.cli import main
    from mosaic.trace import write_jsonl

    from .trajs import compaction_chain

    rng = random.Random(0)
    ok = [compaction_chain(rng, 2, vocab=300, tid=f"t{k}") for k in range(3)]
    bad = compaction_chain(rng, 2, vocab=300, tid="bad")
    bad.sessions[1].completion_ids[0] = 10 ** 6
    common = [f"data.cache_dir={tmp_path / 'cache'}", "model.source=embedded", "model.embedded_preset=tiny",
              "sft.epochs=1", "sft.batch_size=4"]
    write_jsonl(tmp_path / "mixed.jsonl", ok + [bad])
    assert main(["sft", f"sft.data={tmp_path / 'mixed.jsonl'}", f"sft.output_dir={tmp_path / 'o1'}", *common]) == 0
    out = capsys.readouterr().out + capsys.readouterr().err
    assert "1 of 4 trajectories hold token ids outside the model's vocabulary; left out" in out
    assert "session 1 completion_ids holds token id 1000000" in out and "sft: 3 trajectories" in out
    write_jsonl(tmp_path / "bad.jsonl", [bad])
    assert main(["sft", f"sft.data={tmp_path / 'bad.jsonl'}", f"sft.output_dir={tmp_path / 'o2'}", *common]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mosaic sft: config error: config key 'sft.data': ") and "\n" not in err
    assert "1 of 1 trajectories hold token ids outside the model's vocabulary (made with another tokenizer?)" in err


def test_sft_step_in_length_groups_equals_one_padded_batch(tmp_path):
    """The SFT step's micro-batches of similar length give one padded batch's loss and gradient."""
    from mosaic.trace.rows import to_rows
    from mosaic.train.batching import collate, completion_logprobs, pack_rows, row_lengths
    from mosaic.train.sft import sft_step

    cfg = load_config("cpu", overrides=[f"data.cache_dir={tmp_path / 'cache'}", "model.source=embedded",
                                        "harness.context_budget=300"])
    train = setup.load_split(cfg, "train")
    model, tok = setup.build_base_model(cfg, torch.device("cpu"), torch.float32)
    trajs = expert_trajectories(cfg, train, tok, setup.chat_format(tok), n_tasks=6, progress=False)
    rows = pack_rows([r for r in to_rows(trajs) if r.num_trainable > 0])
    lengths = row_lengths(rows)
    assert len(set(lengths)) > 3
    batch = collate(rows, list(range(len(rows))), pad_id=tok.pad_token_id)
    lp, _ = completion_logprobs(model, batch)
    ref = -(lp * batch.loss_mask).sum() / batch.loss_mask.sum()
    model.zero_grad()
    ref.backward()
    ref_grad = [p.grad.clone() for p in model.parameters()]
    loss = sft_step(model, rows, torch.optim.SGD(model.parameters(), lr=0.0), pad_id=tok.pad_token_id,
                    device=torch.device("cpu"), max_grad_norm=1e9, max_tokens=2 * max(lengths))
    assert abs(loss - ref.item()) < 1e-5
    for p, g in zip(model.parameters(), ref_grad):
        assert torch.allclose(p.grad, g, atol=1e-6, rtol=1e-4)
