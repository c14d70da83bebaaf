"""The RL loop end to end on a tiny model: updates, estimators, resume equivalence."""

from __future__ import annotations

import json
import random

import pytest
import torch

from mosaic.core.estimators import ESTIMATORS
from mosaic.train import entrypoints, rl, setup
from mosaic.config.loader import load_config
from mosaic.train.sources import HarnessRollouts

from .conftest import save_tiny_base

# Small enough that an untrained model's rollouts stay cheap (every cap is low).
TINY = [
    "model.source=embedded",
    "model.embedded_preset=tiny",
    "data.n_train_tasks=8",
    "data.n_eval_tasks=3",
    "harness.context_budget=320",
    "harness.max_new_tokens=12",
    "harness.summary_max_new_tokens=12",
    "harness.max_turns=3",
    "harness.max_sessions=3",
    "harness.max_total_turns=6",
    "harness.subagent_max_turns=2",
    "train.batch_tasks=2",
    "train.group_size=2",
    "train.tensorboard=false",
    "train.plot_every=0",
    "optim.lr=0.01",
    "optim.micro_batch_size=3",
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A random tiny embedded model + project tokenizer saved as a model directory."""
    return save_tiny_base(tmp_path_factory, TINY)


def _cfg(base_dir, tmp_path, *extra):
    d, cache = base_dir
    return load_config("cpu", overrides=TINY + [f"data.cache_dir={cache}", "model.source=dir", f"model.path={d}",
                                                f"train.run_dir={tmp_path / 'run'}", *extra])


def _state(cfg):
    from mosaic.train.optim import build_optimizer, build_scheduler

    dev = torch.device("cpu")
    model, tok = setup.load_policy(cfg.model.path, device=dev, dtype=torch.float32)
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, 10)
    return rl.RLState(cfg, model, tok, setup.chat_format(tok), setup.load_split(cfg, "train"), opt, sched, dev)


def test_update_changes_every_parameter_and_lowers_the_loss(base_dir, tmp_path):
    from mosaic.core.loss import policy_loss, token_weights
    from mosaic.trace import to_rows
    from mosaic.train.batching import collate, completion_logprobs

    # The surrogate alone (the KL anchor would pull back toward the warm start).
    cfg = _cfg(base_dir, tmp_path, "algo.estimator=broadcast", "algo.kl_coef=0")
    st = _state(cfg)
    assert st.ref_model is None and isinstance(st.source, HarnessRollouts)  # no source given: the built-in harness, through the one seam
    trajs = rl.rollout(st, rl.tasks_for_step(st.split, 0, 2, 0), step=0)
    rng = random.Random(0)
    rows = to_rows(trajs, [rng.uniform(-1, 1) for _ in range(sum(len(t.sessions) for t in trajs))])
    idx = list(range(len(rows)))

    def loss_now() -> float:
        with torch.no_grad():
            b = collate(rows, idx, pad_id=st.tokenizer.pad_token_id)
            lp, _ = completion_logprobs(st.model, b)
            w = token_weights([r.num_trainable for r in rows], [r.traj_index for r in rows])
            return float(policy_loss(lp, b.old_logprobs, b.advantages, b.loss_mask, w).loss)

    before = {n: p.detach().clone() for n, p in st.model.named_parameters()}
    l0 = loss_now()
    for _ in range(3):
        m = rl.update(st, rows, temperature=1.0)
    l1 = loss_now()
    assert l1 < l0, (l0, l1)
    unchanged = [n for n, p in st.model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, unchanged
    assert m["actor/grad_norm"] > 0 and "actor/pg_loss" in m and "actor/entropy" in m


def test_shared_prefix_update_equals_the_padded_one(base_dir, tmp_path):
    """optim.shared_prefix (prefix_tree) changes no figure of an update with the KL anchor on: the same
    loss, KL, gradient norm (float rounding), from the same rows and weights."""
    from mosaic.trace import to_rows

    outs = []
    for shared in ("true", "false"):
        st = _state(_cfg(base_dir, tmp_path, "algo.kl_coef=0.05", f"optim.shared_prefix={shared}"))
        trajs = rl.rollout(st, rl.tasks_for_step(st.split, 0, 2, 0), step=0)
        rng = random.Random(0)
        rows = to_rows(trajs, [rng.uniform(-1, 1) for _ in range(sum(len(t.sessions) for t in trajs))])
        with torch.no_grad():  # away from the warm start, so the KL term is not zero
            for p in st.model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        outs.append(rl.update(st, rows, temperature=1.0))
    tree, padded = outs
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"):
        assert k in tree, k
        assert tree[k] == pytest.approx(padded[k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("estimator, mode", [(name, "single" if est.single_session else "compaction")
                                             for name, est in ESTIMATORS.items()]
                         + [("mosaic", "fork"), ("mosaic", "reset"), ("broadcast", "reset")])
def test_each_estimator_runs_a_step(base_dir, tmp_path, estimator, mode):
    cfg = _cfg(base_dir, tmp_path, f"algo.estimator={estimator}", f"harness.mode={mode}")
    st = _state(cfg)
    m = rl.rl_step(st, 0)
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "timing_s/gen", "timing_s/score",
                "timing_s/update_actor", "perf/throughput", "critic/advantages/mean", "session/per_traj"):
        assert key in m, key
    if ESTIMATORS[estimator].needs_gains or "turn_gains" in ESTIMATORS[estimator].needs:
        non_final = sum(len(t.sessions) - 1 for t in st.last_trajs)
        assert (m["score/probes"] > 0) == (non_final > 0)
    assert all(v == v for v in m.values() if isinstance(v, float))  # no NaN
    # samples.jsonl lines: the trained estimator is always among the recorded ones, on every session
    recs = st.last_samples
    assert len(recs) == min(cfg.train.rollout_samples, len(st.last_trajs)) > 0
    level = ESTIMATORS[estimator].level
    for r in recs:
        assert r["estimator"] == estimator and estimator not in r["unavailable"]
        assert all(estimator in s["adv" if level == "session" else "turn_adv"] for s in r["sessions"])


def test_skip_uniform_groups_trains_only_on_mixed_groups(base_dir, tmp_path):
    from types import SimpleNamespace as T

    from mosaic.train.batch import drop_uniform_groups

    trajs = [T(group_id="a", reward=1.0), T(group_id="a", reward=0.0), T(group_id="b", reward=0.0),
             T(group_id="b", reward=0.0), T(group_id="c", reward=1.0)]
    kept, dropped = drop_uniform_groups(trajs)
    assert [(t.group_id, t.reward) for t in kept] == [("a", 1.0), ("a", 0.0)] and dropped == 2
    # an untrained model fails every task: both groups are uniform, so the step learns nothing and says so
    cfg = _cfg(base_dir, tmp_path, "algo.estimator=mosaic", "algo.skip_uniform_groups=true")
    st = _state(cfg)
    before = {n: p.detach().clone() for n, p in st.model.named_parameters()}
    m = rl.rl_step(st, 0)
    mixed = len({t.group_id for t in st.last_trajs}) - int(m["train/groups_skipped"])
    assert m["critic/score/mean"] == sum(t.reward for t in st.last_trajs) / len(st.last_trajs)
    if mixed == 0:
        assert m["train/sessions"] == 0 and "actor/pg_loss" not in m
        assert all(torch.equal(p, before[n]) for n, p in st.model.named_parameters())
    else:
        assert m["train/sessions"] > 0 and "actor/pg_loss" in m


def test_a_checkpoint_the_trainer_writes_loads_with_the_auto_classes(base_dir, tmp_path):
    """vLLM, SGLang, verl and TRL load a model with AutoTokenizer / AutoModelForCausalLM: a
    checkpoint written by ``mosaic train`` must give the ids and logits training used."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mosaic.agent.tokenizer import CHECK_TEXTS

    cfg = _cfg(base_dir, tmp_path, "train.steps=1", "train.save_every=1", "train.eval_every=0")
    assert entrypoints.run_train(cfg) == 0
    d = tmp_path / "run" / "checkpoints" / "ckpt-1" / "model"
    model, tok = setup.load_policy(str(d), device=torch.device("cpu"), dtype=torch.float32)
    auto = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    for text in CHECK_TEXTS:
        assert auto(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, dtype=torch.float32).eval()
    ids = torch.tensor([tok(CHECK_TEXTS[1], add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=0, atol=0)


def _train_killed_at(cfg, at_step, monkeypatch):
    """``run_train`` killed (KeyboardInterrupt) when it reaches step ``at_step``."""
    real_step = rl.rl_step

    def dying(st, step):
        if step == at_step:
            raise KeyboardInterrupt("killed")
        return real_step(st, step)

    monkeypatch.setattr(entrypoints, "rl_step", dying)
    with pytest.raises(KeyboardInterrupt):
        entrypoints.run_train(cfg)
    monkeypatch.setattr(entrypoints, "rl_step", real_step)


@pytest.mark.parametrize("anchor", [[], ["algo.kl_coef=0.05"]], ids=["no-kl", "kl-anchor"])
def test_killed_run_resumes_to_the_same_parameters_and_metrics(base_dir, tmp_path, monkeypatch, anchor):
    """With the KL anchor too: a resumed run's reference is the warm start, not the checkpoint it resumes."""
    common = ["algo.estimator=mosaic", "train.steps=3", "train.save_every=1", "train.keep_last=5",
              "train.eval_every=0", *anchor]
    full = _cfg(base_dir, tmp_path / "a", *common)
    assert entrypoints.run_train(full) == 0

    killed = _cfg(base_dir, tmp_path / "b", *common)
    _train_killed_at(killed, 2, monkeypatch)
    assert entrypoints.run_train(killed) == 0  # train.resume=auto picks up ckpt-2

    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "a" / "run" / "checkpoints" / "ckpt-3" / "model" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "run" / "checkpoints" / "ckpt-3" / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)

    def metrics(run):
        lines = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in m.items() if not k.startswith(("timing_s", "perf/"))} for m in lines]

    ma, mb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [m["step"] for m in mb] == [1, 2, 3]
    for x, y in zip(ma, mb):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), k
    ra = json.loads((tmp_path / "a" / "run" / "result.json").read_text())
    rb = json.loads((tmp_path / "b" / "run" / "result.json").read_text())
    assert ra["final"] == rb["final"]


def test_resume_with_a_changed_config_is_refused_unless_forced(base_dir, tmp_path, monkeypatch, capsys):
    # issue 11: resuming with a changed estimator and lr=0.5 gave no warning.
    from mosaic.cli import main
    from mosaic.train.checkpoint import CheckpointError

    common = ["train.steps=2", "train.save_every=1", "train.eval_every=0"]
    _train_killed_at(_cfg(base_dir, tmp_path, "algo.estimator=broadcast", *common), 1, monkeypatch)
    changed = _cfg(base_dir, tmp_path, "algo.estimator=mosaic", "optim.lr=0.5", *common)
    evals = []
    with monkeypatch.context() as m:  # refused before the warm start's evaluation (it would rewrite its cached result)
        m.setattr(entrypoints, "_heldout_eval", lambda *a, **k: evals.append(a) or {})
        with pytest.raises(CheckpointError) as exc:
            entrypoints.run_train(changed)
    assert evals == []
    assert "algo.estimator: 'broadcast' -> 'mosaic'" in str(exc.value) and "optim.lr: 0.01 -> 0.5" in str(exc.value)
    run = tmp_path / "run"
    assert not (run / "checkpoints" / "ckpt-2").exists()  # refused before any step
    # The command line: exit 2 and the keys, no traceback.
    d, cache = base_dir
    argv = ["train", *TINY, f"data.cache_dir={cache}", "model.source=dir", f"model.path={d}", f"train.run_dir={run}",
            "algo.estimator=mosaic", "optim.lr=0.5", *common]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "changed config" in err and "algo.estimator: 'broadcast' -> 'mosaic'" in err and "Traceback" not in err
    assert main(argv + ["train.resume_force=true"]) == 0
    assert (run / "checkpoints" / "ckpt-2").exists()


@pytest.mark.parametrize("estimator, mode", [("mosaic", "compaction"), ("fold", "compaction")])
def test_a_step_runs_each_estimator_once_and_samples_hold_the_trained_advantages(base_dir, tmp_path, monkeypatch,
                                                                                estimator, mode):  # fmt: skip
    """samples.jsonl reuses the step's values: no estimator runs twice, the trained one's equal the rows'."""
    import dataclasses

    calls: dict[str, int] = {}

    def counted(name, fn):
        def run(b, p):
            calls[name] = calls.get(name, 0) + 1
            return fn(b, p)

        return run

    for name, est in list(ESTIMATORS.items()):
        monkeypatch.setitem(ESTIMATORS, name, dataclasses.replace(est, fn=counted(name, est.fn)))
    trained: list = []
    monkeypatch.setattr(rl, "update", lambda st, rows, temperature: trained.extend(rows) or {})
    cfg = _cfg(base_dir, tmp_path, f"algo.estimator={estimator}", f"harness.mode={mode}", "train.rollout_samples=4")
    st = _state(cfg)
    rl.rl_step(st, 0)
    assert calls and set(calls.values()) == {1}, calls  # every estimator that ran, ran once
    assert estimator in calls and len(trained) == sum(len(t.sessions) for t in st.last_trajs)
    by_traj: dict[int, list] = {}
    for r in trained:
        by_traj.setdefault(r.traj_index, []).append(r)
    level = ESTIMATORS[estimator].level
    for i, rec in enumerate(st.last_samples):
        rows = sorted(by_traj[i], key=lambda r: r.session_index)
        assert len(rows) == len(rec["sessions"])
        for row, s in zip(rows, rec["sessions"]):
            if level == "session":
                assert s["adv"][estimator] == pytest.approx(row.advantage, rel=1e-5, abs=1e-6)
            else:  # each turn's value on its sampled tokens, in order (equal neighbours collapse alike)
                got = _runs([a for a, m in zip(row.token_advantages, row.loss_mask) if m])
                assert got == pytest.approx(_runs(s["turn_adv"][estimator]), rel=1e-5, abs=1e-6)


def _runs(values):
    out = []
    for v in values:
        if not out or abs(out[-1] - v) > 1e-5 * max(1.0, abs(v)):
            out.append(v)
    return out


def test_rollout_training_agreement_is_logged_and_a_mismatched_sampler_warns(base_dir, tmp_path, capsys):
    """Issue 33 item 7: the trainer's recomputed token probabilities against the sampler's, on the trained
    tokens before the update: a matched sampler (the built-in harness, same weights and temperature) agrees
    above 0.99; log-probs from perturbed weights or from a temperature other than the one trained with move
    the figures and warn."""
    import copy

    from mosaic.trace import to_rows
    from mosaic.train.agreement import CORR
    from mosaic.train.batching import collate, completion_logprobs

    cfg = _cfg(base_dir, tmp_path, "algo.estimator=broadcast")
    st = _state(cfg)
    trajs = rl.rollout(st, rl.tasks_for_step(st.split, 0, 2, 0), step=0)
    rows = to_rows(trajs, [0.5] * sum(len(t.sessions) for t in trajs))
    fresh = {k: v.clone() for k, v in st.model.state_dict().items()}

    def sampled_by(model, temperature: float):
        """The rows with the log-probs ``model`` gives their tokens at ``temperature`` (a mismatched sampler)."""
        with torch.no_grad():
            lp, _ = completion_logprobs(model, collate(rows, range(len(rows)), pad_id=st.tokenizer.pad_token_id),
                                        temperature=temperature)
        out = copy.deepcopy(rows)
        for k, r in enumerate(out):
            r.logprobs = [float(x) if m else 0.0 for x, m in zip(lp[k, : len(r.completion_ids)], r.loss_mask)]
        return out

    T = cfg.rollout.temperature

    def update_from_fresh(rs):
        st.model.load_state_dict(fresh)
        return rl.update(st, rs, temperature=T)

    noisy = copy.deepcopy(st.model)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(0)) * 0.5 * p.std().clamp(min=1e-3))
    got = {}
    for name, rs in [("matched", rows), ("temperature", sampled_by(st.model, T / 2)), ("perturbed", sampled_by(noisy, T))]:
        got[name] = update_from_fresh(rs)
        got[name]["stderr"] = capsys.readouterr().err
    m = got["matched"]
    assert m["training/rollout_agreement_tokens"] == sum(r.num_trainable for r in rows)
    assert m[CORR] > 0.99 and m["training/rollout_probs_diff_mean"] < 1e-3, m
    assert m["training/rollout_agreement_warn"] == 0.0 and "Pearson" not in m["stderr"]
    for name in ("temperature", "perturbed"):
        bad = got[name]
        assert bad["training/rollout_probs_diff_mean"] > 10 * m["training/rollout_probs_diff_mean"], (name, bad)
        assert bad[CORR] < 0.99 and bad["training/rollout_agreement_warn"] == 1.0, (name, bad)
        assert "Pearson" in bad["stderr"] and "rollout.agreement_warn_corr=0.99" in bad["stderr"]


@pytest.mark.parametrize("partner", ["frozen", "expert", "self"])
def test_reset_mode_trains_with_each_partner_and_only_its_own_role(base_dir, tmp_path, partner):
    """Issue 30: two alternating roles; with a frozen or scripted partner its sessions stay in the graph
    (scored) but give no training tokens ("central-only" training)."""
    cfg = _cfg(base_dir, tmp_path, "algo.estimator=mosaic", "harness.mode=reset", "harness.reset_k=2",
               'harness.reset_roles=["searcher: find and note", "checker: verify and answer"]',
               f"harness.partner={partner}")
    st = _state(cfg)
    m = rl.rl_step(st, 0)
    assert m["actor/grad_norm"] >= 0 and "session/count/reset" in m
    sessions = [s for t in st.last_trajs for s in t.sessions]
    assert sessions and all(s.kind == "reset" for s in sessions)
    played = [s for s in sessions if s.meta.get("partner")]
    if partner == "self":
        assert not played
    else:
        assert played and all(s.meta["role"] == 1 and not any(s.loss_mask) for s in played)
        assert all(any(s.loss_mask) for s in sessions if not s.meta.get("partner") and s.num_turns)


def test_the_periodic_validation_is_logged_beside_the_training_rollouts_not_over_them(base_dir, tmp_path):
    """A step with ``train.eval_every`` logs the validation rollouts' metrics under ``val-aux/`` and keeps the
    training rollouts' own (issue 28: the mechanism report compares both; the validation's used to overwrite
    the training values of that step)."""
    from mosaic.train.runlog import read_metrics

    cfg = _cfg(base_dir, tmp_path, "algo.estimator=mosaic", "train.steps=2", "train.eval_every=1", "train.save_every=0")
    assert entrypoints.run_train(cfg) == 0
    rows = {m["step"]: m for m in read_metrics(tmp_path / "run") if "step" in m}
    first, second = rows[1], rows[2]
    assert any(k.startswith("val-core/") for k in first) and not any(k.startswith("val-core/") for k in second)
    for m in (first, second):
        assert "session/per_traj" in m and "session/pos_gain_share/all" in m and "critic/score/mean" in m
    assert "val-aux/session/per_traj" in first and "val-aux/session/pos_gain_share/all" in first
    assert not any(k.startswith("val-aux/session/") for k in second)
