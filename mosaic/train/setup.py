"""From a :class:`~mosaic.config.loader.Config` to the objects a run needs.

Splits, the harness configuration, the policy model + tokenizer and the
sampling policy are built here, once, so that SFT, RL and evaluation agree on
every setting.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mosaic.agent.chat import ChatFormat
from mosaic.agent.models.embedded import EmbeddedModelConfig, build_model, load_model
from mosaic.agent.models.smollm2 import load_smollm2
from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
from mosaic.agent.models.corpus import build_generator_tokenizer
from mosaic.envs.cache import resolve_cache_dir
from mosaic.envs.splits import load_split as _load_split
from mosaic.config.loader import Config
from mosaic.envs.splits import split_config_for

log = logging.getLogger(__name__)

BASE_MODELS_DIR = Path(__file__).resolve().parent.parent / "assets" / "models"
"""Where the shipped base models live (``<preset>-base``, built by ``mosaic pretrain``)."""


def resolve_device(cfg: Config) -> torch.device:
    want = cfg.model.device
    if want == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(want)


def resolve_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.model.dtype)


def load_split(cfg: Config, split: str):
    """The split ``split`` of ``cfg``'s task family: deep search's :class:`~mosaic.envs.splits.Split` (its
    world, tasks and search index), or the service family's episodes
    (:class:`~mosaic.envs.service.splits.ServiceSplit`). :func:`mosaic.agent.episode.make_env` gives the
    harness its environment."""
    if cfg.data.family == "service":
        from mosaic.envs.service.splits import load_service_split_for

        return load_service_split_for(cfg, split)
    return _load_split(split, split_config_for(cfg, split), cache_dir=resolve_cache_dir(cfg.data.cache_dir))


def base_model_dir(preset: str, name: str = "") -> Path:
    """The shipped base model ``name`` (default: the one of embedded preset ``preset``, ``<preset>-base``);
    raises if it was never built."""
    path = BASE_MODELS_DIR / (name or f"{preset}-base")
    if not (path / "config.json").exists():
        known = sorted(p.name for p in BASE_MODELS_DIR.iterdir() if (p / "config.json").exists()) \
            if BASE_MODELS_DIR.is_dir() else []
        build = (f"`mosaic pretrain model.base={name} --into-package ...` (docs/models.md)" if name
                 else f"`mosaic pretrain model.embedded_preset={preset} --into-package`")
        raise FileNotFoundError(
            f"no shipped base model {path.name!r} (shipped: {', '.join(known) or 'none'}); build it with {build}, "
            f"or use model.source=dir with a saved model")
    return path


def build_base_model(cfg: Config, device: torch.device, dtype: torch.dtype):
    """The policy before the warm start: the shipped pretrained base model (``base``), a freshly
    initialised embedded model (``embedded``; tokenizer from generated training-partition worlds, so
    no held-out world shapes the vocabulary), or a saved / SmolLM2 model."""
    src = cfg.model.source
    if src == "base":
        model, tok = load_policy(base_model_dir(cfg.model.embedded_preset, cfg.model.base), device=device, dtype=dtype)
    elif src == "embedded":
        tok = build_generator_tokenizer(harness_config=cfg.harness)
        mcfg = EmbeddedModelConfig.preset(cfg.model.embedded_preset)
        model = build_model(mcfg, tok, seed=cfg.model.init_seed)
    elif src == "dir":
        model, tok = load_policy(cfg.model.path, device=device, dtype=dtype)
    else:  # smollm2
        model, tok = load_smollm2()
    return model.to(device=device, dtype=dtype), tok


def load_policy(path: str | Path, *, device: torch.device, dtype: torch.dtype):
    """A saved model directory (ours or any HF causal LM with a fast tokenizer)."""
    model, tok = load_model(path, device=device, dtype=dtype)
    return model, tok


def chat_format(tokenizer) -> ChatFormat:
    chat = ChatFormat(tokenizer)
    chat.check_prefix_preservation()
    return chat


def sampling_policy(cfg: Config, model, tokenizer, *, temperature: float | None = None, seed: int = 0,
                    batch_size: int | None = None):
    """A batched KV-cache :class:`~mosaic.agent.policies.local.LocalPolicy` over the live model."""
    r = cfg.rollout
    pc = LocalPolicyConfig(
        temperature=r.temperature if temperature is None else temperature,
        top_p=r.top_p,
        max_batch_size=r.batch_size if batch_size is None else batch_size,
        seed=seed,
    )
    return LocalPolicy(model, tokenizer, pc)


def frozen_copy(model):
    """A frozen copy of ``model`` (eval mode, no gradients): the KL reference, a frozen partner."""
    import copy

    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def partner_policy(cfg: Config, tokenizer, split, frozen_model=None, *, seed: int = 0,
                   temperature: float | None = None, batch_size: int | None = None):
    """The policy that plays the partner's role in reset mode (``harness.partner``), or None when the
    trained policy plays both: :func:`partner_for` over ``split``'s tasks at ``cfg.rollout``'s sampling
    settings (``temperature`` and ``batch_size`` override theirs)."""
    r = cfg.rollout
    return partner_for(cfg.harness.partner, tokenizer, split.tasks, frozen_model, seed=seed,
                       temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                       batch_size=r.batch_size if batch_size is None else batch_size)


def partner_for(partner: str, tokenizer, tasks, frozen_model=None, *, seed: int = 0, temperature: float = 1.0,
                top_p: float = 1.0, batch_size: int = 64):
    """Who plays reset mode's second role, by ``harness.partner``: None (``self``: the trained policy), the
    scripted expert (no noise) over ``tasks``, or a local sampler over ``frozen_model`` (a frozen copy of the
    warm start) on a seed stream of its own. Used by ``mosaic train``, its evaluation and the TRL and verl
    rollouts alike."""
    if partner == "self":
        return None
    if partner == "expert":
        from mosaic.agent.expert import ExpertNoise, ExpertPolicy

        return ExpertPolicy(tokenizer, tasks, ExpertNoise.off(), seed=seed)
    if frozen_model is None:
        raise ValueError("harness.partner='frozen' needs the frozen warm start (frozen_model)")
    return LocalPolicy(frozen_model, tokenizer, LocalPolicyConfig(temperature=temperature, top_p=top_p,
                                                                   max_batch_size=batch_size, seed=seed + 7919))

