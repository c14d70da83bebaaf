"""``mosaic pretrain``: the embedded base model from expert rollouts over generated training worlds."""

from __future__ import annotations

import json
import random

import pytest

from mosaic.train import pretrain as pt
from mosaic.train import setup
from mosaic.config.loader import load_config

SMALL = ["model.embedded_preset=tiny", "data.n_eval_tasks=2", "harness.context_budget=300",
         "harness.max_new_tokens=16", "harness.summary_max_new_tokens=16", "harness.max_turns=3",
         "harness.max_sessions=3", "harness.max_total_turns=6"]


def test_pretrain_trains_saves_and_records(tmp_path):
    cfg = load_config("cpu", overrides=SMALL + [f"data.cache_dir={tmp_path / 'cache'}"])
    pc = pt.PretrainConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=1, eval_every=6, eval_tasks=2,
                           tokenizer_worlds=4, tasks_per_world=4, pool_rows=8)
    out = tmp_path / "base"
    meta = pt.pretrain(cfg, pc, out, progress=False)
    from mosaic.agent.models.embedded import load_model

    model, tok = load_model(out)
    assert sum(p.numel() for p in model.parameters()) == meta["parameters"]
    saved = json.loads((out / pt.META_FILE).read_text())
    assert saved["config"]["steps"] == 6 and saved["worlds"] >= 2 and saved["checks"][-1]["step"] == 6
    assert 0.0 <= saved["checks"][-1]["validation_accuracy"] <= 1.0
    assert saved["harness"]["context_budget"] == 300


def test_pretraining_worlds_are_training_partition_and_disjoint_from_held_out(tmp_path):
    from mosaic.agent.models.corpus import build_generator_tokenizer
    from mosaic.envs.names import in_partition
    from mosaic.envs.splits import check_disjoint
    from mosaic.train import setup

    cfg = load_config("cpu", overrides=SMALL + [f"data.cache_dir={tmp_path / 'cache'}"])
    tok = build_generator_tokenizer(n_worlds=2)
    chat = setup.chat_format(tok)
    pc = pt.PretrainConfig()
    rows, info = pt.world_rows(cfg, pc, 0, tok, chat, tmp_path / "gen")
    assert rows and info["trajectories"] == pc.tasks_per_world and info["mode"] == pc.modes[0]
    from mosaic.envs.splits import load_split, split_config

    world = load_split("train", split_config("train", "cpu", seed=pc.world_seed_base), tmp_path / "gen").world
    assert world.config.seed == info["world_seed"]
    assert all(in_partition(n, (0, 3)) for n in world.names())
    check_disjoint({"pretrain": world, "validation": setup.load_split(cfg, "validation").world,
                    "test": setup.load_split(cfg, "test").world})


def test_missing_base_model_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(setup, "BASE_MODELS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="mosaic pretrain"):
        setup.base_model_dir("tiny")


def test_bad_pretrain_config_is_rejected():
    with pytest.raises(ValueError, match="steps"):
        pt.PretrainConfig(steps=0)
    with pytest.raises(ValueError, match="pool_rows"):
        pt.PretrainConfig(pool_rows=8, batch_size=16)
    with pytest.raises(ValueError, match="modes"):
        pt.PretrainConfig(modes=())


def test_lm_step_expert_part_equals_the_sft_loss(tmp_path):
    """The pretraining loss's expert-token term is exactly the SFT loss; context tokens add the rest."""
    import torch

    from mosaic.agent.models.corpus import build_generator_tokenizer
    from mosaic.train import setup
    from mosaic.train.batching import collate, completion_logprobs

    from .conftest import tiny_model

    cfg = load_config("cpu", overrides=SMALL + [f"data.cache_dir={tmp_path / 'cache'}"])
    tok = build_generator_tokenizer(n_worlds=2)
    rows, _ = pt.world_rows(cfg, pt.PretrainConfig(tasks_per_world=3), 0, tok, setup.chat_format(tok),
                             tmp_path / "gen")
    model = tiny_model(vocab_size=len(tok), seed=1)
    batch = collate(rows, list(range(len(rows))), pad_id=tok.pad_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch)
    sft_loss = float(-(lp * batch.loss_mask).sum() / batch.loss_mask.sum())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    act, ctx = pt.lm_step(model, rows, opt, pad_id=tok.pad_token_id, device=torch.device("cpu"),
                          context_weight=0.5)
    assert abs(act - sft_loss) < 1e-4 and ctx > 0


def test_lm_step_in_length_groups_equals_one_padded_batch(tmp_path):
    """Micro-batches of similar length give the padded batch's loss and gradient (token means over the
    whole batch), and the grouping never pads a group beyond its budget."""
    import torch
    import torch.nn.functional as F

    from mosaic.agent.models.corpus import build_generator_tokenizer
    from mosaic.train import setup
    from mosaic.train.batching import collate, length_groups, row_lengths

    from .conftest import tiny_model

    cfg = load_config("cpu", overrides=SMALL + [f"data.cache_dir={tmp_path / 'cache'}"])
    tok = build_generator_tokenizer(n_worlds=2)
    rows, info = pt.world_rows(cfg, pt.PretrainConfig(tasks_per_world=8), 0, tok, setup.chat_format(tok),
                                tmp_path / "gen")
    rng = random.Random(0)
    rows = rows + [pt.copy_drill(rng, tok, info["names"]) for _ in range(3)]  # short rows beside long ones
    lengths = row_lengths(rows)
    assert lengths == [collate(rows, [i], pad_id=tok.pad_token_id).input_ids.shape[1] for i in range(len(rows))]
    assert len(set(lengths)) > 5 and max(lengths) > 3 * min(lengths)

    model = tiny_model(vocab_size=len(tok), seed=1)
    # the reference: one right-padded batch; expert tokens = each row's trained completion tokens, context
    # tokens = every other real token (built here, not with the code under test)
    batch = collate(rows, list(range(len(rows))), pad_id=tok.pad_token_id)
    act = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    for j in range(len(rows)):
        for k in range(batch.loss_mask.shape[1]):
            if batch.loss_mask[j, k]:
                act[j, int(batch.prompt_lens[j]) + k] = True
    act_t, real_t = act[:, 1:], batch.attention_mask[:, 1:].bool()
    ctx_t = real_t & ~act_t
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.input_ids[:, 1:].reshape(-1),
                          reduction="none").view_as(batch.input_ids[:, 1:])
    ref_act, ref_ctx = (nll * act_t).sum() / act_t.sum(), (nll * ctx_t).sum() / ctx_t.sum()
    model.zero_grad()
    (ref_act + 0.5 * ref_ctx).backward()
    ref_grad = [p.grad.clone() for p in model.parameters()]

    budget = 2 * max(lengths)
    groups = length_groups(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(rows))) and len(groups) > 2
    assert all(len(g) * max(lengths[i] for i in g) <= budget for g in groups)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    act, ctx = pt.lm_step(model, rows, opt, pad_id=tok.pad_token_id, device=torch.device("cpu"),
                          context_weight=0.5, max_grad_norm=1e9, max_tokens=budget)
    assert abs(act - ref_act.item()) < 1e-5 and abs(ctx - ref_ctx.item()) < 1e-5
    for p, g in zip(model.parameters(), ref_grad):
        assert torch.allclose(p.grad, g, atol=1e-6, rtol=1e-4)
    assert length_groups([5, 100, 7], 50) == [[0, 2], [1]]  # a row over the budget goes alone


def test_a_stopped_pretraining_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    """Stopped after its state was saved at step 4, started again with the same ``out``: it goes on from
    step 4 and ends with the weights of a run that was never stopped; another config is refused."""
    import torch

    from mosaic.agent.models.embedded import load_model

    cfg = load_config("cpu", overrides=SMALL + [f"data.cache_dir={tmp_path / 'cache'}"])
    pc = pt.PretrainConfig(steps=7, batch_size=4, lr=3e-3, warmup_steps=1, eval_every=0, save_every=2,
                           tokenizer_worlds=4, tasks_per_world=4, pool_rows=8, copy_share=0.25)
    torch.set_num_threads(1)
    whole = pt.pretrain(cfg, pc, tmp_path / "whole", progress=False)
    assert not (tmp_path / "whole" / pt.STATE_FILE).exists()

    real, calls = pt.lm_step, []

    def stop_after_five(*a, **k):
        if len(calls) == 5:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(pt, "lm_step", stop_after_five)
    with pytest.raises(KeyboardInterrupt):
        pt.pretrain(cfg, pc, tmp_path / "split", progress=False)
    monkeypatch.setattr(pt, "lm_step", real)
    assert torch.load(tmp_path / "split" / pt.STATE_FILE, weights_only=False)["step"] == 4
    with pytest.raises(pt.PretrainError, match="another config.*lr"):
        pt.pretrain(cfg, pt.PretrainConfig(**{**pc.__dict__, "lr": 1e-3}), tmp_path / "split", progress=False)
    other = load_config("cpu", overrides=SMALL + [f"data.cache_dir={tmp_path / 'cache'}", "harness.max_turns=4"])
    with pytest.raises(pt.PretrainError, match="harness.max_turns: 3 -> 4"):
        pt.pretrain(other, pc, tmp_path / "split", progress=False)
    meta = pt.pretrain(cfg, pc, tmp_path / "split", progress=False)
    assert meta["resumed_at"] == 4 and meta["worlds"] == whole["worlds"]
    assert meta["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-5)
    a, _ = load_model(tmp_path / "whole")
    b, _ = load_model(tmp_path / "split")
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=n)
    assert not (tmp_path / "split" / pt.STATE_FILE).exists()


def test_pretraining_refuses_an_unreadable_state_and_a_finished_run(tmp_path):
    cfg = load_config("cpu", overrides=SMALL + [f"data.cache_dir={tmp_path / 'cache'}"])
    pc = pt.PretrainConfig(steps=2, batch_size=4, warmup_steps=1, eval_every=0, tokenizer_worlds=4,
                           tasks_per_world=4, pool_rows=8)
    out = tmp_path / "base"
    out.mkdir()
    for bad in (b"", b"not a torch file", b"PK\x03\x04truncated"):
        (out / pt.STATE_FILE).write_bytes(bad)
        with pytest.raises(pt.PretrainError, match="cannot be read.*remove it to start over"):
            pt.pretrain(cfg, pc, out, progress=False)
    import torch

    torch.save({"step": 1}, out / pt.STATE_FILE)
    with pytest.raises(pt.PretrainError, match="not a pretraining state"):
        pt.pretrain(cfg, pc, out, progress=False)
    (out / pt.STATE_FILE).unlink()
    pt.pretrain(cfg, pc, out, progress=False)
    with pytest.raises(pt.PretrainError, match="holds a finished pretraining run"):
        pt.pretrain(cfg, pc, out, progress=False)
    assert pt.pretrain(cfg, pc, out, progress=False, overwrite=True)["config"]["steps"] == 2


def test_service_share_mixes_both_families_and_cycles_modes_over_deep_search_worlds(tmp_path):
    """``service_share`` spreads service batches evenly over the worlds; the harness modes cycle over the
    deep-search worlds only; a service world's rows are the revalidating expert's successful episodes of
    training-partition users, disjoint from the service validation and test users."""
    from mosaic.agent.models.corpus import build_generator_tokenizer
    from mosaic.envs.service.splits import check_disjoint, episode_names

    pc = pt.PretrainConfig(service_share=0.5, modes=("compaction", "fork", "reset"), tasks_per_world=6)
    assert [pc.is_service(k) for k in range(6)] == [False, True] * 3
    assert [pc.mode(k) for k in (0, 2, 4, 6)] == ["compaction", "fork", "reset", "compaction"]
    third = pt.PretrainConfig(service_share=1 / 3)
    assert sum(third.is_service(k) for k in range(30)) == 10
    assert not any(pt.PretrainConfig().is_service(k) for k in range(20))

    cfg = load_config("cpu", overrides=SMALL + [f"data.cache_dir={tmp_path / 'cache'}"])
    tok = build_generator_tokenizer(n_worlds=2)
    rows, info = pt.world_rows(cfg, pc, 1, tok, setup.chat_format(tok), tmp_path / "gen")
    assert info["family"] == "service" and info["trajectories"] == 6 and info["mode"] == "compaction"
    assert [pc.mode(k) for k in (1, 3, 5, 7)] == ["compaction", "compaction", "reset", "compaction"]
    assert rows and info["names"] and info["expert_accuracy"] > 0  # (a 2-world tokenizer: long texts, many compactions)
    svc = pt.service_config(cfg, pc)
    assert svc.data.family == "service" and svc.harness.context_budget == 1792  # the cpu-service budget
    assert all(len(r.prompt_ids) + len(r.completion_ids) <= 2048 for r in rows)
    from dataclasses import replace

    pre = setup.load_split(svc.replace(data=replace(svc.data, seed=pc.world_seed_base + 1, n_train_tasks=6)), "train")
    check_disjoint({"pretrain": pre.tasks, "validation": setup.load_split(svc, "validation").tasks,
                    "test": setup.load_split(svc, "test").tasks})
    assert {e.user for e in pre.tasks} <= set(info["names"])
    assert episode_names(pre.tasks[0])


def test_service_pretraining_checks_both_families_and_refuses_bad_settings(tmp_path):
    cfg = load_config("cpu", overrides=SMALL + [f"data.cache_dir={tmp_path / 'cache'}"])
    pc = pt.PretrainConfig(steps=4, batch_size=4, lr=3e-3, warmup_steps=1, eval_every=4, eval_tasks=2,
                           tokenizer_worlds=4, tasks_per_world=4, pool_rows=8, service_share=0.5, service_drills=0.5,
                           copy_share=0.5)
    meta = pt.pretrain(cfg, pc, tmp_path / "base", progress=False)
    assert meta["service_worlds"] >= 1 and meta["worlds"] > meta["service_worlds"]
    check = meta["checks"][-1]
    assert 0.0 <= check["validation_accuracy"] <= 1.0 and 0.0 <= check["service_validation_accuracy"] <= 1.0
    with pytest.raises(ValueError, match="service_share"):
        pt.PretrainConfig(service_share=1.0)
    with pytest.raises(ValueError, match="unknown harness mode"):
        pt.PretrainConfig(modes=("compaction", "resett"))
    with pytest.raises(ValueError, match="unknown harness mode"):
        pt.PretrainConfig(service_modes=("forks",))
    assert pt.PretrainConfig(service_modes=("fork", "compaction+fork")).service_modes  # (the expert audits by forks)
    with pytest.raises(pt.PretrainError, match="not a service-family preset"):
        pt.service_config(cfg, pt.PretrainConfig(service_preset="cpu"))
    svc = load_config("cpu-service")
    with pytest.raises(pt.PretrainError, match="data.family=service"):
        pt.pretrain(svc, pc, tmp_path / "svc", progress=False)


def test_model_base_names_a_shipped_base_model(tmp_path, monkeypatch):
    from mosaic.config.values import ConfigError

    assert setup.base_model_dir("tiny", "tiny-base") == setup.base_model_dir("tiny")
    with pytest.raises(FileNotFoundError, match="no shipped base model 'nope'.*shipped: .*tiny-base"):
        setup.base_model_dir("tiny", "nope")
    with pytest.raises(ConfigError, match="model.base"):
        load_config("cpu", overrides=["model.base=../x"])
    with pytest.raises(ConfigError, match="model.base.*model.source=base"):
        load_config("cpu", overrides=["model.source=embedded", "model.base=tiny-base"])


def test_a_run_stopped_before_a_knob_was_added_resumes_when_the_knob_is_at_its_default():
    now = pt._fingerprint(load_config("cpu"), pt.PretrainConfig())
    saved = {k: v for k, v in now.items() if k not in ("service_share", "service_modes", "service_preset")}
    assert pt._same_run(saved, now) == []
    changed = pt._fingerprint(load_config("cpu"), pt.PretrainConfig(service_share=0.5))
    assert pt._same_run(saved, changed) == ["service_share: None -> 0.5"]


def test_a_missing_base_model_is_one_line_before_any_work(tmp_path, capsys):
    from mosaic.cli import main

    assert main(["train", "model.base=nope", f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "config key 'model.base': no shipped base model 'nope'" in err
    assert "mosaic pretrain model.base=nope --into-package" in err and not (tmp_path / "run").exists()
    grid = tmp_path / "g.yaml"
    grid.write_text("name: g\npreset: cpu\ncommon: [model.base=nope]\narms: {a: [algo.estimator=broadcast]}\nseeds: [0]\n"
                    "evals: [{name: v, split: validation, n_tasks: 2}]\n")
    assert main(["experiment", str(grid), "--work", str(tmp_path / "w"), "--dry-run"]) == 0
    assert "no shipped base model 'nope'" in capsys.readouterr().err
    assert main(["experiment", str(grid), "--work", str(tmp_path / "w")]) == 2
    assert "no shipped base model 'nope'" in capsys.readouterr().err
    assert main(["pretrain", "--into-package", "model.base=README.md"]) == 2


def test_service_account_drills_read_values_and_write_the_rule_s_call():
    """``service_drills``: an account and orders as the lookups show them, then a question or a request whose
    one tool call must be written; the answer is what the family's rules give on the shown state."""
    import random

    from mosaic.agent.models.corpus import build_generator_tokenizer
    from mosaic.envs.service import ServiceConfig, generate_episodes, parse_call
    from mosaic.envs.service.text import parse_account, parse_orders

    tok = build_generator_tokenizer(n_worlds=2)
    rng = random.Random(0)
    episodes = generate_episodes(ServiceConfig(seed=3, n_users=20, visits=2))
    kinds = set()
    for i in range(200):
        row = pt.service_drill(rng, tok, episodes[i % 20].initial)
        prompt = tok.decode(row.prompt_ids)
        answer = tok.decode(row.completion_ids).replace("<|im_end|>", "")
        body = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        lines = body.splitlines()
        account = parse_account("\n".join(lines[:5]))
        orders = parse_orders("\n".join(lines[5:-1]))
        assert account and orders and all(row.loss_mask) and len(row.completion_ids) == len(row.loss_mask)
        call = parse_call(answer)
        if call is None:
            kinds.add("question")
            assert answer.startswith("<answer>") and answer.endswith("</answer>")
            if "last four digits" in lines[-1]:
                assert answer == f"<answer>{account['card']}</answer>"
        else:
            kinds.add(call[0])
            if call[0] == "create_order":
                assert call[1]["address"] == account["address"] and call[1]["card"] == account["card"]
            if call[0] in ("cancel_order", "return_order"):
                o = orders[call[1]["order_id"]]
                assert (o["status"] == "placed") == (call[0] == "cancel_order")
            if call[0] in ("change_plan", "renew_plan"):
                assert (account["plan_status"] == "active") == (call[0] == "change_plan")
    assert {"question", "create_order", "change_plan", "renew_plan"} <= kinds and kinds & {"cancel_order", "return_order"}
    with pytest.raises(ValueError, match="service_drills"):
        pt.PretrainConfig(service_drills=1.5)
