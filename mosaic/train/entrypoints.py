"""What ``mosaic train | sft | eval`` run once the config is valid.

``mosaic train`` with no arguments (the CPU preset) is the project's main job:

1. warm start: the shipped base model (CPU preset, ``model.source=base``: built
   by ``mosaic pretrain``, SFT on scripted-expert rollouts over generated
   training worlds); for other sources, if no SFT model for this config
   exists, run ``mosaic sft`` (scripted-expert rollouts → SFT), cached under
   ``sft.output_dir`` and keyed by the config sections that shape it;
2. evaluate the warm start on held-out **test** questions (a world disjoint
   from training) — cached in the run dir;
3. RL steps (rollouts, gains, advantages, PPO update) with metrics, plots and
   atomic checkpoints; ``train.resume=auto`` continues a killed run;
4. evaluate the result on the same test questions and report the paired
   difference with its 95 % bootstrap interval.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from mosaic.agent.models.embedded import save_model
from mosaic.trace import TraceError, ids_outside, load_trajectories, write_jsonl
from mosaic.train import setup
from mosaic.train.checkpoint import check_resume_config, find_latest, load_checkpoint, resolve_resume, save_checkpoint
from mosaic.config.loader import Config, ConfigError, config_tree, dump_config, resolve_steps
from mosaic.train.evaluate import evaluate, paired_outcomes
from mosaic.train.hf_export import save_final_model, set_sampling_defaults
from mosaic.train.metrics import as_val_aux
from mosaic.train.optim import build_optimizer, build_scheduler
from mosaic.train.rl import RLState, make_reference, rl_step
from mosaic.train.sources import open_source
from mosaic.train.runlog import RunLogger, write_summary
from mosaic.train.samples import vocab_pieces
from mosaic.train.sft import expert_trajectories, sft_train
from mosaic.train.stats import paired_bootstrap

__all__ = ["RunPlan", "prepare_run", "run_train", "run_sft", "run_eval", "ensure_warm_start"]

_SFT_META = "mosaic_sft.json"


@dataclass(frozen=True)
class RunPlan:
    run_dir: Path
    resume_from: Path | None
    """Checkpoint to resume from (``train.resume``), or None for a fresh run."""
    config_yaml: str
    config_checked: bool = False
    """The resumed run's saved config was compared with this one (before the warm start's evaluation)."""


def prepare_run(cfg: Config) -> RunPlan:
    """Resolve the resume point (fails loud on a bad ``train.resume`` path) and the run dir; writes nothing."""

    run_dir = Path(cfg.train.run_dir)
    return RunPlan(run_dir=run_dir, resume_from=resolve_resume(cfg.train.resume, run_dir),
                   config_yaml=dump_config(cfg))  # fmt: skip


def _sft_key(cfg: Config) -> str:
    """Hash of everything that shapes the warm start (model, data, harness, sft)."""
    blob = json.dumps({k: asdict(getattr(cfg, k)) for k in ("model", "data", "harness", "sft")},
                      sort_keys=True, default=str)  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _log(msg: str) -> None:
    print(f"[mosaic] {msg}", flush=True)


# ----------------------------------------------------------------------------- SFT


def run_sft(cfg: Config) -> int:
    """``mosaic sft``: expert rollouts → SFT → a saved warm-start model (always retrains)."""
    _train_sft(cfg)
    return 0


def _train_sft(cfg: Config) -> Path:
    t0 = time.perf_counter()
    trajs = None
    if cfg.sft.data:  # read first: a file that is not trajectories fails before the model is built
        try:
            trajs = load_trajectories(cfg.sft.data)
        except (TraceError, OSError) as exc:
            raise ConfigError(f"config key 'sft.data': {exc}") from None
        if not trajs:
            raise ConfigError(f"config key 'sft.data': {cfg.sft.data} holds no trajectories")
    torch.manual_seed(cfg.train.seed)
    device = setup.resolve_device(cfg)
    dtype = setup.resolve_dtype(cfg, device)
    train = setup.load_split(cfg, "train")
    model, tok = setup.build_base_model(cfg, device, dtype)
    chat = setup.chat_format(tok)
    out = Path(cfg.sft.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if trajs is not None:
        trajs = _fitting_vocab(trajs, model.get_input_embeddings().num_embeddings, f"config key 'sft.data': {cfg.sft.data}")
        _log(f"sft: {len(trajs)} trajectories from {cfg.sft.data}")
    else:
        noise = "none: the service expert has no noise knobs" if cfg.data.family == "service" else cfg.sft.expert_noise
        _log(f"sft: rolling the scripted expert over {cfg.sft.n_tasks} training tasks "
             f"(mode={cfg.harness.mode}, noise={noise})")
        trajs = expert_trajectories(cfg, train, tok, chat, n_tasks=cfg.sft.n_tasks, seed=cfg.train.seed)
        write_jsonl(out / "expert.jsonl", trajs)
    expert_acc = sum(t.success for t in trajs) / max(1, len(trajs))
    n_params = sum(p.numel() for p in model.parameters())
    _log(f"sft: expert accuracy {100 * expert_acc:.1f} %; training {n_params / 1e6:.2f}M parameters")
    res = sft_train(model, trajs, cfg, pad_id=tok.pad_token_id, device=device, seed=cfg.train.seed)
    set_sampling_defaults(model, cfg)
    save_model(model, tok, out)
    meta = {"key": _sft_key(cfg), "expert_accuracy": expert_acc, "trajectories": len(trajs),
            "steps": res.steps, "final_loss": res.final_loss, "seconds": time.perf_counter() - t0,
            "tokens": res.tokens, "parameters": n_params}  # fmt: skip
    (out / _SFT_META).write_text(json.dumps(meta, indent=1))
    _log(f"sft: {res.steps} steps, final loss {res.final_loss:.3f}, {meta['seconds']:.0f} s → {out}")
    return out


def _fitting_vocab(trajs: list, vocab_size: int, where: str) -> list:
    """``trajs`` without those holding a token id the model has no embedding for: each one left out is
    counted and the first named; none left is a :class:`ConfigError`."""
    bad = [(k, why) for k, t in enumerate(trajs) if (why := ids_outside(t, vocab_size))]
    if not bad:
        return trajs
    k, why = bad[0]
    head = f"{where}: {len(bad)} of {len(trajs)} trajectories hold token ids outside the model's vocabulary"
    if len(bad) == len(trajs):
        raise ConfigError(f"{head} (made with another tokenizer?); the first, trajectory {k}: {why}")
    _log(f"sft: {head}; left out (the first, trajectory {k}: {why})")
    skip = {k for k, _ in bad}
    return [t for k, t in enumerate(trajs) if k not in skip]


def ensure_warm_start(cfg: Config) -> Path:
    """The warm-start model directory for this config.

    ``model.source=dir``: that model as it is; ``base``: the shipped base model (itself SFT on
    scripted-expert rollouts, over hundreds of generated training worlds — an SFT on the training
    split's one world would only teach it that world's names); otherwise the SFT model under
    ``sft.output_dir``, reused when its key matches, else (re)trained."""
    if cfg.model.source == "dir":
        return Path(cfg.model.path)
    if cfg.model.source == "base":  # the shipped base model is already an SFT on expert rollouts
        path = setup.base_model_dir(cfg.model.embedded_preset, cfg.model.base)
        _log(f"warm start: the shipped base model {path.name} (SFT by `mosaic pretrain` on expert "
             f"rollouts over generated training worlds)")
        return path
    out = Path(cfg.sft.output_dir)
    meta = out / _SFT_META
    if meta.exists():
        try:
            if json.loads(meta.read_text()).get("key") == _sft_key(cfg):
                _log(f"warm start: reusing {out}")
                return out
        except (OSError, ValueError):
            pass
        _log(f"warm start: {out} was made for another config; retraining")
    return _train_sft(cfg)


# ----------------------------------------------------------------------------- eval


def run_eval(cfg: Config, checkpoint: str | None, out: str | None) -> int:
    """``mosaic eval``: accuracy (95 % CI) and session statistics of a model on ``data.eval_split``."""

    device = setup.resolve_device(cfg)
    dtype = setup.resolve_dtype(cfg, device)
    path = Path(checkpoint) if checkpoint else find_latest(cfg.train.run_dir)
    if path is None:
        path = ensure_warm_start(cfg)
        what = (f"the warm start of model.source={cfg.model.source} (no checkpoint in train.run_dir="
                f"{cfg.train.run_dir}; pass --checkpoint to evaluate another model)")
    elif (path / "model").is_dir():
        what = f"checkpoint {path.name}" + ("" if checkpoint else f" (the latest of train.run_dir={cfg.train.run_dir})")
        path = path / "model"
    elif not (path / "config.json").exists():
        found = find_latest(path)
        if found is None:
            raise FileNotFoundError(f"{path}: neither a model directory nor a run dir with checkpoints")
        what, path = f"checkpoint {found.name} (the latest of run dir {path})", found / "model"
    else:
        what = "a model directory"
    _log(f"evaluating {path}: {what}")
    model, tok = setup.load_policy(path, device=device, dtype=dtype)
    chat = setup.chat_format(tok)
    split = setup.load_split(cfg, cfg.data.eval_split)
    partner = None
    if cfg.harness.partner == "frozen":  # reset mode's frozen partner plays from the warm start
        partner, _ = setup.load_policy(ensure_warm_start(cfg), device=device, dtype=dtype)
    res = evaluate(cfg, model, tok, chat, split, n_tasks=cfg.data.n_eval_tasks or None,
                   samples=cfg.train.eval_samples, temperature=cfg.train.eval_temperature, out=out,
                   partner_model=partner)  # fmt: skip
    _log(f"model {path}")
    _log(res.line(f"eval[{cfg.data.eval_split}]"))
    for k in sorted(res.metrics):
        if k.startswith(("session/", "env/", "reset/", "val-core/", "val-aux/")):  # env/: the service outcome
            print(f"  {k}: {res.metrics[k]:.4f}")
    if out:
        _log(f"per-question outcomes → {out}")
    return 0


# ----------------------------------------------------------------------------- train


def run_train(cfg: Config) -> int:
    """``mosaic train``: warm start (cached) → held-out eval → RL → held-out eval and paired CI."""
    t_start = time.perf_counter()
    if "wandb" in cfg.train.sinks() and cfg.train.logger is not None:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:  # before minutes of warm-start evaluation
            raise ConfigError("config key 'train.logger': lists wandb but the wandb package is not installed "
                              "(pip install wandb, or drop wandb from train.logger)")
    if cfg.rollout.source == "harness":  # a harness or reward that cannot be loaded fails before any work
        from mosaic.train.usercode import check_callables

        check_callables(cfg.rollout)
    replay = _records_replay(cfg)  # captured records that cannot be read fail before the warm start's evaluation
    plan = prepare_run(cfg)
    if plan.resume_from is not None and (plan.resume_from.parent.parent / "config.yaml").is_file():
        # a resume that must not go on stops before the warm start is evaluated (and its cached result rewritten)
        check_resume_config(plan.resume_from.parent.parent, plan.config_yaml, cfg.train.resume_force)
        plan = replace(plan, config_checked=True)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.train.seed)
    device = setup.resolve_device(cfg)
    model, tok = setup.load_policy(ensure_warm_start(cfg), device=device, dtype=setup.resolve_dtype(cfg, device))
    set_sampling_defaults(model, cfg)  # in every checkpoint's and the final model's generation_config.json
    if replay is not None:  # ids the model has no embedding for: dropped and counted, before the evaluation
        try:
            replay.drop_outside_vocab(model.get_input_embeddings().num_embeddings)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    chat = setup.chat_format(tok)
    # reset mode's frozen partner plays from the warm start: copied before a resume loads a checkpoint
    partner = setup.frozen_copy(model) if cfg.harness.partner == "frozen" else None
    held = None if cfg.train.heldout_split == "none" else setup.load_split(cfg, cfg.train.heldout_split)
    base = _heldout_eval(cfg, plan.run_dir, "warmstart", model, tok, chat, held, partner) if held is not None else None
    final = _rl_loop(cfg, plan, model, tok, chat, device, replay, base=base, partner_model=partner,
                     final_eval=(lambda: _heldout_eval(cfg, plan.run_dir, "final", model, tok, chat, held, partner))
                     if held is not None else None)
    if held is not None:
        extra = _report_gain(cfg, plan.run_dir, base, final, time.perf_counter() - t_start)
        write_summary(plan.run_dir, title=f"mosaic train ({cfg.algo.estimator})", extra=extra)
    return 0


def _heldout_eval(cfg: Config, run_dir: Path, name: str, model, tok, chat, split, partner_model=None) -> dict:
    """Evaluate on the held-out split (``eval_<name>.jsonl`` outcomes); the warm start's result is
    cached in the run dir so a resumed run reuses it."""
    meta = run_dir / f"eval_{name}.json"
    where = cfg.train.heldout_split
    key = _eval_key(cfg)
    if name == "warmstart" and meta.exists() and (run_dir / f"eval_{name}.jsonl").exists():
        res = json.loads(meta.read_text())
        if res.get("key", key) == key:  # (a cache from before the key: reused as before)
            _log(f"warm start on {where} (cached): {100 * res['accuracy']:.1f} %")
            return res
        _log(f"warm start on {where}: the cached result was measured under another harness, data, model or "
             "evaluation setting; evaluating again")
    label, what = ("warm start", "the warm start") if name == "warmstart" else ("after RL", "the model after RL")
    n_tasks = cfg.data.n_eval_tasks or len(split.tasks)
    _log(f"evaluating {what} on {where}: {n_tasks} questions x {cfg.train.eval_samples} samples")
    r = evaluate(cfg, model, tok, chat, split, n_tasks=n_tasks,
                 samples=cfg.train.eval_samples, temperature=cfg.train.eval_temperature,
                 out=run_dir / f"eval_{name}.jsonl", partner_model=partner_model,
                 progress=f"eval {label}" if "console" in cfg.train.sinks() else False)  # fmt: skip
    res = {"split": where, "accuracy": r.accuracy, "lo": r.lo, "hi": r.hi, "outcomes": r.outcomes,
           "metrics": r.metrics, "key": key}  # fmt: skip
    meta.write_text(json.dumps(res))
    _log(r.line(f"{label} on {where}"))
    return res


def _eval_key(cfg: Config) -> str:
    """What a held-out result depends on besides the weights: the harness (its partner included), data and
    model sections and the evaluation's own settings (a cached warm-start result is reused only under it)."""
    t = cfg.train
    return json.dumps([config_tree(cfg.harness), config_tree(cfg.data), config_tree(cfg.model), t.heldout_split,
                       t.eval_samples, t.eval_temperature], sort_keys=True, default=str)


def _records_replay(cfg: Config):
    """The captured rollouts of ``rollout.source=records`` (None for other sources); a records path that
    is missing or unreadable is a :class:`ConfigError`."""
    if cfg.rollout.source != "records":
        return None
    from mosaic.train.replay import RecordsReplay

    try:
        return RecordsReplay(cfg)
    except (OSError, ValueError) as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith("rollout.records") else f"rollout.records: {msg}") from None


def _run_logger(cfg: Config, plan: RunPlan, steps: int, start: int) -> RunLogger:
    return RunLogger(plan.run_dir, config_yaml=plan.config_yaml, total_steps=steps, start_step=start,
                     logger=cfg.train.logger, tensorboard=cfg.train.tensorboard, wandb=cfg.train.wandb,
                     project_name=cfg.train.project_name, experiment_name=cfg.train.experiment_name,
                     log_every=cfg.train.log_every, plot_every=cfg.train.plot_every,
                     title=f"mosaic train ({cfg.algo.estimator})")


def heldout_metrics(cfg: Config, res: dict) -> dict[str, float]:
    """A held-out evaluation's accuracy and its interval, named for the sinks by its family and split
    (``val-core/deepsearch-test/acc/mean@N``: apart from the periodic validation's names)."""
    fam = cfg.data.family
    src = f"/{fam}/"
    return {k.replace(src, f"/{fam}-{res['split']}/", 1): v for k, v in res["metrics"].items()
            if k.startswith(("val-core/", "val-aux/")) and src in k}


def _rl_loop(cfg: Config, plan: RunPlan, model, tok, chat, device, replay=None, *, base: dict | None = None,
             partner_model=None,
             final_eval=None) -> dict | None:
    """RL steps from the resume point to the end: metrics, samples, checkpoints. The held-out results
    go to the sinks: ``base`` (the warm start's) at step 0 on a fresh run, ``final_eval()``'s (run
    after the last step, returned) at the last step."""
    train = setup.load_split(cfg, "train")
    source, n_groups = open_source(cfg, model, tok, chat, train, plan.run_dir, log=_log,
                                   resumed=plan.resume_from is not None, replay=replay, partner_model=partner_model)
    try:
        steps = resolve_steps(cfg, n_groups if n_groups is not None else len(train.tasks))
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, steps * cfg.optim.ppo_epochs * cfg.optim.mini_batches)
        # The KL anchor is the warm start: copied before a resume loads the checkpoint's weights into `model`
        # (a frozen partner is already such a copy: the same frozen weights serve both).
        ref = None
        if cfg.algo.kl_coef > 0:
            ref = partner_model if partner_model is not None else make_reference(model)
        start = 0
        if plan.resume_from is not None:
            ck = load_checkpoint(plan.resume_from, model=model, optimizer=optimizer, scheduler=scheduler)
            start = ck.step
            if not plan.config_checked:  # (an older run without config.yaml: the checkpoint's estimator)
                check_resume_config(plan.resume_from.parent.parent, plan.config_yaml, cfg.train.resume_force,
                                    state=ck.state)
            _log(f"resumed from {plan.resume_from} at step {start}")
        st = RLState(cfg, model, tok, chat, train, optimizer, scheduler, device, ref_model=ref, source=source)
        return _run_steps(st, plan, start, steps, base=base, final_eval=final_eval)
    finally:
        source.close()


def _run_steps(st: RLState, plan: RunPlan, start: int, steps: int, *, base: dict | None,
               final_eval) -> dict | None:
    """Steps ``start``..``steps`` of a run: each step's metrics (and validation every ``train.eval_every``),
    samples and checkpoints, then the final model and its held-out evaluation; the logger closes whatever
    happens."""
    cfg, model, tok, chat = st.cfg, st.model, st.tokenizer, st.chat
    val = setup.load_split(cfg, cfg.data.eval_split) if cfg.train.eval_every else None
    logger = _run_logger(cfg, plan, steps, start)
    if cfg.train.rollout_samples and not (plan.run_dir / "vocab.json").exists():  # the ids' texts (mosaic view)
        (plan.run_dir / "vocab.json").write_text(json.dumps({"pieces": vocab_pieces(tok)}))
    extra, final = None, None
    if base is not None and start == 0:
        logger.log_eval(0, heldout_metrics(cfg, base))
    try:
        for step in range(start, steps):
            m = rl_step(st, step)
            n = step + 1
            if val is not None and n % cfg.train.eval_every == 0 and n < steps:
                r = evaluate(cfg, model, tok, chat, val, n_tasks=cfg.data.n_eval_tasks or None, samples=1,
                             temperature=cfg.train.eval_temperature,
                             progress=f"eval step {n}" if "console" in cfg.train.sinks() else False)  # fmt: skip
                m.update(as_val_aux(r.metrics))
            logger.log(n, m)
            if cfg.train.rollout_samples:
                logger.log_samples(n, st.last_samples)
            if (cfg.train.save_every and n % cfg.train.save_every == 0) or n == steps:
                save_checkpoint(plan.run_dir, n, model=model, tokenizer=tok, optimizer=st.optimizer,
                                scheduler=st.scheduler, state={"step": n, "estimator": cfg.algo.estimator},
                                keep_last=cfg.train.keep_last)
        extra = {"steps": str(steps), "final model": str(save_final_model(plan.run_dir, model, tok))}
        _log(f"final model (Hugging Face layout) → {extra['final model']}")
        if final_eval is not None:
            final = final_eval()
            logger.log_eval(steps, heldout_metrics(cfg, final))
    finally:
        logger.close(extra=extra)
    return final


def _report_gain(cfg: Config, run_dir: Path, base: dict, final: dict, seconds: float) -> dict[str, str]:
    """Paired held-out gain of the final model over the warm start → log line, ``result.json`` and the
    lines for the run's summary."""
    a, b = paired_outcomes(final["outcomes"], base["outcomes"])
    cmp = paired_bootstrap(a, b, seed=cfg.train.seed)
    verdict = "excludes 0" if (cmp.lo > 0 or cmp.hi < 0) else "includes 0"
    _log(f"held-out gain over the warm start: {100 * cmp.diff:+.1f} points "
         f"(95 % paired bootstrap CI [{100 * cmp.lo:+.1f}, {100 * cmp.hi:+.1f}], {verdict}; "
         f"{cmp.wins} wins / {cmp.losses} losses / {cmp.ties} ties on {cmp.n_questions} questions)")
    _log(f"this is one training seed ({cfg.train.seed}) on one {cfg.train.heldout_split} split, its tasks as "
         f"the unit (exact sign test p = {cmp.p_value:.3f}): whether RL moved this model, not whether an "
         f"estimator trains better; that takes seeds as the unit (docs/results.md, reports/)")
    (run_dir / "result.json").write_text(json.dumps({
        "split": cfg.train.heldout_split,
        "warm_start": {k: base[k] for k in ("accuracy", "lo", "hi")},
        "final": {k: final[k] for k in ("accuracy", "lo", "hi")},
        "gain": asdict(cmp), "final_metrics": final["metrics"], "seconds": seconds,
    }, indent=1))
    where = cfg.train.heldout_split
    return {f"warm start {where} accuracy": f"{100 * base['accuracy']:.1f} %",
            f"final {where} accuracy": f"{100 * final['accuracy']:.1f} % [{100 * final['lo']:.1f}, {100 * final['hi']:.1f}]",
            "held-out gain (paired 95 % CI)": f"{100 * cmp.diff:+.1f} [{100 * cmp.lo:+.1f}, {100 * cmp.hi:+.1f}]",
            "wall time": f"{seconds:.0f} s"}  # fmt: skip

