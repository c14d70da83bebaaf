"""Pretraining the embedded base model (``mosaic pretrain``).

A ~1M-parameter model trained from scratch on a few hundred expert trajectories
learns the format but not the one skill deep search rests on: copying an entity
name it has never seen from the question or a search hit into the next query,
summary or answer (measured: 0 % on a held-out world after 4 or 10 SFT epochs).
That takes thousands of updates over many different names — more than the main
job's 15-minute CPU budget — so the project builds the base model once, with this
module, and ships it (``mosaic/assets/models/<preset>-base``), as one would start
from any pretrained checkpoint.

The data are scripted-expert rollouts (with the same noise as the warm start) over
a stream of freshly generated worlds in the **training** name partition (split
``train`` of the CPU preset under other data seeds). No validation or test world
is ever trained on: the periodic check runs on the validation world. The
tokenizer is :func:`mosaic.agent.models.corpus.build_generator_tokenizer`, trained on
other generated training-partition worlds, so no split's names are merged whole.
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mosaic.agent.models.corpus import build_generator_tokenizer
from mosaic.agent.models.embedded import EmbeddedModelConfig, build_model, load_model, save_model
from mosaic.train import setup
from mosaic.train.batching import collate, length_groups, row_lengths
from mosaic.config.loader import Config
from mosaic.train.evaluate import evaluate
from mosaic.train.optim import lr_factor
from mosaic.train.setup import BASE_MODELS_DIR, base_model_dir  # noqa: F401  (re-exported: where the base models live)
from mosaic.train.pretrain_data import PretrainConfig, PretrainError, copy_drill, service_config, service_drill, world_rows

log = logging.getLogger(__name__)

__all__ = ["PretrainConfig", "PretrainError", "pretrain", "BASE_MODELS_DIR", "base_model_dir", "world_rows", "copy_drill",
           "service_drill", "service_config"]


META_FILE = "mosaic_pretrain.json"
STATE_FILE = "pretrain_state.pt"
"""The resumable state of an unfinished run (weights, optimizer, schedule, row pool, random states), in
``out``; removed when the run finishes."""

_RESUME_IGNORES = ("save_every", "eval_every", "eval_tasks")  # may change between the pieces of one run


def _fingerprint(cfg: Config, pc: "PretrainConfig") -> dict:
    """What decides the trained weights: the recipe, the model preset, the harness and data sections."""
    data = {k: v for k, v in asdict(cfg.data).items() if k != "cache_dir"}
    return {**asdict(pc), "embedded_preset": cfg.model.embedded_preset, "harness": asdict(cfg.harness), "data": data}


def _same_run(saved: dict, now: dict) -> list[str]:
    """The knobs that differ between a saved state and this run (those that change what is trained)."""
    out = []
    defaults = {f.name: f.default for f in fields(PretrainConfig)}
    for k, v in now.items():
        if k in _RESUME_IGNORES or saved.get(k) == v:
            continue
        if k not in saved and k in defaults and v == defaults[k]:  # a knob added since, left at its default
            continue
        if isinstance(v, dict) and isinstance(saved.get(k), dict):
            out += [f"{k}.{f}: {saved[k].get(f)!r} -> {x!r}" for f, x in v.items() if saved[k].get(f) != x]
        else:
            out.append(f"{k}: {saved.get(k)!r} -> {v!r}")
    return out


_STATE_KEYS = ("config", "step", "model", "opt", "sched", "rng", "torch_rng", "rows", "names", "worlds", "checks",
               "losses", "seconds")


def _load_state(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)  # our own file (rows are objects)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file, whatever torch.load raises
        raise PretrainError(f"{path} cannot be read ({type(exc).__name__}: {exc}); remove it to start over") from None
    if not isinstance(state, dict) or any(k not in state for k in _STATE_KEYS):
        raise PretrainError(f"{path} is not a pretraining state of this version; remove it to start over")
    return state


def _masks(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(target is an expert token, target is another real token), both (R, L - 1)."""
    attn = batch.attention_mask
    act = torch.zeros_like(attn, dtype=torch.bool)  # (R, L): position holds an expert token
    r, k = batch.loss_mask.nonzero(as_tuple=True)  # only trained tokens: padding never lands anywhere
    act[r, batch.prompt_lens[r] + k] = True
    target_act, target_real = act[:, 1:], attn[:, 1:].bool()
    return target_act, target_real & ~target_act


def lm_step(model, rows, opt: torch.optim.Optimizer, *, pad_id: int, device: torch.device,
            context_weight: float, max_grad_norm: float = 1.0, max_tokens: int = 8192) -> tuple[float, float]:
    """One step of next-token loss over whole sequences: token mean over the expert's tokens plus
    ``context_weight`` × token mean over every other real token. Returns both means.

    The rows run in micro-batches of similar length (:func:`length_groups`, ``max_tokens`` padded
    positions each; gradients accumulated, each group's sums divided by the whole batch's token
    counts), so the step's loss and gradient are those of one padded batch, up to float rounding,
    without computing the padding (about 40 % of a padded batch of expert rows)."""
    batches = [collate(rows, g, pad_id=pad_id) for g in length_groups(row_lengths(rows), max_tokens)]
    masks = [_masks(b) for b in batches]
    n_act = max(1, sum(int(a.sum()) for a, _ in masks))
    n_ctx = max(1, sum(int(c.sum()) for _, c in masks))
    opt.zero_grad(set_to_none=True)
    l_act = l_ctx = 0.0
    for batch, (target_act, target_ctx) in zip(batches, masks):
        batch, target_act, target_ctx = batch.to(device), target_act.to(device), target_ctx.to(device)
        ids = batch.input_ids
        logits = model(input_ids=ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, :-1]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1),
                              reduction="none").view_as(ids[:, 1:])
        part_act = (nll * target_act).sum() / n_act
        part_ctx = (nll * target_ctx).sum() / n_ctx
        (part_act + context_weight * part_ctx).backward()
        l_act, l_ctx = l_act + float(part_act.detach()), l_ctx + float(part_ctx.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    return l_act, l_ctx


# Long on purpose: one training loop whose state (model, optimiser, schedule, data stream, periodic validation and saving) lives in its locals.
class _Run:
    """One pretraining run's state: model, optimiser, schedule, the row pool and the record so far.
    Everything :meth:`save` writes is what :meth:`restore` reads back, so a resumed run goes on exactly."""

    def __init__(self, cfg: Config, pc: PretrainConfig, out: Path, device: torch.device):
        self.cfg, self.pc, self.out = cfg, pc, out
        self.state_path = out / STATE_FILE
        self.fingerprint = _fingerprint(cfg, pc)
        self.tok = build_generator_tokenizer(vocab_size=pc.vocab_size, n_worlds=pc.tokenizer_worlds,
                                             harness_config=cfg.harness)
        self.chat = setup.chat_format(self.tok)
        if pc.init:
            self.model, init_tok = load_model(pc.init)
            if init_tok.get_vocab() != self.tok.get_vocab():
                raise PretrainError(f"PretrainConfig.init: {pc.init} has another tokenizer than this recipe builds")
        else:
            self.model = build_model(EmbeddedModelConfig.preset(cfg.model.embedded_preset), self.tok, seed=pc.seed)
        self.model.to(device)
        self.device = device
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=pc.lr, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.rng = random.Random(pc.seed)
        self.rows: list = []
        self.names: list[str] = []
        self.accounts: list[dict] = []  # service episodes' initial accounts, for the account drills
        self.worlds: list[dict] = []
        self.checks: list[dict] = []
        self.losses: list[float] = []
        self.start, self.before, self.t0 = 0, 0.0, time.perf_counter()
        self.resumed_at: int | None = None

    def _lr_factor(self, s: int) -> float:  # warm-up, then cosine down to 10 % of the peak
        pc = self.pc
        f = lr_factor(s, warmup_steps=pc.warmup_steps, total_steps=pc.steps, schedule="cosine")
        return f if s < pc.warmup_steps else 0.1 + 0.9 * f

    def elapsed(self) -> float:
        """Seconds of this run, the pieces before a resume included."""
        return self.before + time.perf_counter() - self.t0

    def restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        self.rows, self.names, self.worlds, self.checks, self.losses = (
            state[k] for k in ("rows", "names", "worlds", "checks", "losses"))
        self.accounts = state.get("accounts", [])  # (a state saved before account drills existed has none)
        self.start, self.before = state["step"], state["seconds"]
        self.resumed_at = state["step"]

    def save(self, step: int) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        torch.save({"config": self.fingerprint, "step": step, "model": self.model.state_dict(),
                    "opt": self.opt.state_dict(), "sched": self.sched.state_dict(), "rng": self.rng.getstate(),
                    "torch_rng": torch.get_rng_state(), "rows": self.rows, "names": self.names, "accounts": self.accounts,
                    "worlds": self.worlds, "checks": self.checks, "losses": self.losses,
                    "seconds": self.elapsed()}, tmp)
        tmp.replace(self.state_path)  # whole or not at all: a kill while writing keeps the previous state

    def step(self, cache: Path) -> tuple[float, float]:
        """One LM step on a batch from the pool (refilled with fresh worlds' expert rows when half empty)
        plus copy drills; (loss, context loss)."""
        pc = self.pc
        if len(self.rows) < pc.pool_rows // 2:
            while len(self.rows) < pc.pool_rows:
                new, info = world_rows(self.cfg, pc, len(self.worlds), self.tok, self.chat, cache)
                self.rows += new
                self.names = (self.names + info.pop("names"))[-2000:]
                self.accounts = (self.accounts + info.pop("accounts", []))[-500:]
                self.worlds.append(info)
            self.rng.shuffle(self.rows)
        n_drills = sum(self.rng.random() < pc.copy_share for _ in range(pc.batch_size))
        n_rows = pc.batch_size - n_drills
        batch = self.rows[len(self.rows) - n_rows:] + [
            service_drill(self.rng, self.tok, self.rng.choice(self.accounts))
            if pc.service_drills and self.accounts and self.rng.random() < pc.service_drills
            else copy_drill(self.rng, self.tok, self.names) for _ in range(n_drills)]
        del self.rows[len(self.rows) - n_rows:]
        loss, ctx_loss = lm_step(self.model, batch, self.opt, pad_id=self.tok.pad_token_id, device=self.device,
                                 context_weight=pc.context_weight)
        self.sched.step()
        self.losses.append(loss)
        return loss, ctx_loss

    def check(self, step: int, vals: dict) -> str:
        """Greedy validation accuracy now on each family's validation split (``vals``: key -> (config,
        split)); the latest weights saved, loadable while the run goes on."""
        self.model.eval()
        acc = {key: evaluate(c, self.model, self.tok, self.chat, split, n_tasks=self.pc.eval_tasks,
                             score_gains=False, progress=False).accuracy for key, (c, split) in vals.items()}
        self.model.train()
        self.checks.append({"step": step, "loss": sum(self.losses[-50:]) / len(self.losses[-50:]), **acc,
                            "seconds": self.elapsed()})
        save_model(self.model, self.tok, self.out)
        shown = ", ".join(f"{k.replace('_', ' ')} {100 * v:.1f} %" for k, v in acc.items())
        return f"pretrain step {step}: loss {self.checks[-1]['loss']:.3f}, greedy {shown} ({len(self.worlds)} worlds)"

    def meta(self) -> dict:
        cfg, pc, worlds = self.cfg, self.pc, self.worlds
        n_traj = sum(w["trajectories"] for w in worlds)
        return {"config": asdict(pc), "embedded_preset": cfg.model.embedded_preset,
                "parameters": sum(p.numel() for p in self.model.parameters()),
                "harness": {k: getattr(cfg.harness, k) for k in ("context_budget", "max_new_tokens",
                                                                  "summary_max_new_tokens")},
                "worlds": len(worlds), "trajectories": n_traj,
                "service_worlds": sum(w.get("family") == "service" for w in worlds),
                "expert_accuracy": sum(w["expert_accuracy"] * w["trajectories"] for w in worlds) / max(1, n_traj),
                "final_loss": sum(self.losses[-50:]) / len(self.losses[-50:]), "checks": self.checks,
                "seconds": self.elapsed(), "torch_threads": torch.get_num_threads(),
                **({"resumed_at": self.resumed_at} if self.resumed_at is not None else {})}


def _saved_state(out: Path, fingerprint: dict, overwrite: bool) -> dict | None:
    """The stopped run of this config in ``out`` (None when there is none); a PretrainError for another
    config's unfinished run, or a finished run unless ``overwrite``."""
    state_path = out / STATE_FILE
    if state_path.exists():  # a stopped run of this config: go on from its last saved step
        state = _load_state(state_path)
        if drift := _same_run(state["config"], fingerprint):
            raise PretrainError(f"{out} holds an unfinished pretraining run of another config ({'; '.join(drift)}); "
                                f"pass another output dir or remove {state_path}")
        return state
    if (out / META_FILE).exists() and not overwrite:
        raise PretrainError(f"{out} holds a finished pretraining run ({META_FILE}); pass another output dir "
                            f"or remove it")
    return None


def pretrain(cfg: Config, pc: PretrainConfig, out: str | Path, *, progress: bool = True,
             overwrite: bool = False) -> dict:
    """Train the embedded base model ``cfg.model.embedded_preset`` and save it to ``out``: resumes the
    unfinished run of the same config there; refuses an unfinished run of another config, or a finished
    run unless ``overwrite``."""
    out = Path(out)
    if cfg.data.family != "deepsearch":
        raise PretrainError(f"data.family={cfg.data.family}: pretraining runs on deep search worlds and mixes "
                            f"the service family in with service_share (--service-share)")
    state = _saved_state(out, _fingerprint(cfg, pc), overwrite)
    torch.manual_seed(pc.seed)
    run = _Run(cfg, pc, out, setup.resolve_device(cfg))
    vals = {"validation_accuracy": (cfg, setup.load_split(cfg, "validation"))}
    if pc.service_share > 0:  # the second family is checked on its own validation episodes
        scfg = service_config(cfg, pc)
        vals["service_validation_accuracy"] = (scfg, setup.load_split(scfg, "validation"))
    if state is not None:
        run.restore(state)
        log.warning("pretrain: resumed from step %d of %d (%s)", run.start, pc.steps, run.state_path)
    out.mkdir(parents=True, exist_ok=True)
    run.model.train()
    bar = tqdm(total=pc.steps, initial=run.start, desc="pretrain", disable=not progress)
    with tempfile.TemporaryDirectory(prefix="mosaic-pretrain-") as cache:
        for step in range(run.start, pc.steps):
            loss, ctx_loss = run.step(Path(cache))
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", ctx=f"{ctx_loss:.3f}", worlds=len(run.worlds))
            n = step + 1
            if pc.eval_every and (n % pc.eval_every == 0 or n == pc.steps):
                bar.write(run.check(n, vals))
            if n < pc.steps and ((pc.save_every and n % pc.save_every == 0) or (pc.eval_every and n % pc.eval_every == 0)):
                run.save(n)
    bar.close()
    run.model.eval()
    save_model(run.model, run.tok, out)
    meta = run.meta()
    Path(out, META_FILE).write_text(json.dumps(meta, indent=1))
    run.state_path.unlink(missing_ok=True)
    run.state_path.with_suffix(".tmp").unlink(missing_ok=True)  # from a save a kill interrupted
    return meta
