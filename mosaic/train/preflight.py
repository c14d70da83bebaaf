"""Paths a ``mosaic train | sft | eval`` config names, checked before any work (issue 33): one line
naming the config key, or None.

The config's own validation checks values; these checks look at the file system: a run, output or
data-cache directory that cannot be created (``/proc/x``, an existing file, a read-only parent), a
trajectory or records file that does not exist, a model directory that will not load (no or an
unparsable ``config.json``, a truncated or corrupt safetensors file:
:mod:`mosaic.agent.models.checkdir`). Nothing is written.
"""

from __future__ import annotations

from pathlib import Path

from mosaic.config.cliargs import output_error

__all__ = ["train_error", "train_notes", "sft_error", "eval_error", "family_error", "warm_start_error"]


def _key(name: str) -> str:
    return f"config key {name!r}:"


def warm_start_error(cfg) -> str | None:
    """The model a run starts from is missing or unreadable (a shipped base model not in the package, a
    ``model.path`` that is not a model); None when it is there."""
    if cfg.model.source == "base":  # the shipped base model must be in the package
        from mosaic.train.setup import base_model_dir

        try:
            base_model_dir(cfg.model.embedded_preset, cfg.model.base)
        except FileNotFoundError as exc:
            return f"{_key('model.base' if cfg.model.base else 'model.embedded_preset')} {exc}"
        return None
    if cfg.model.source != "dir":
        return None
    from mosaic.agent.models.checkdir import model_dir_error

    bad = model_dir_error(cfg.model.path)
    return f"{_key('model.path')} {bad}" if bad else None


def _input_file_error(name: str, value: str, *, dir_ok: bool = False) -> str | None:
    p = Path(value)
    if not p.exists():
        return f"{_key(name)} {p}: no such file" + (" or directory" if dir_ok else "")
    if p.is_dir() and not dir_ok:
        return f"{_key(name)} {p}: is a directory, not a file"
    try:
        if p.is_file():
            with open(p, "rb"):
                pass
        else:
            next(iter(p.iterdir()), None)
    except OSError as exc:
        return f"{_key(name)} {p}: cannot be read ({exc.strerror or exc})"
    return None


def family_error(cfg) -> str | None:
    """A setting the service family (``data.family=service``) cannot run: the scripted reset partner plays
    deep search only (docs/service.md)."""
    if cfg.data.family == "deepsearch":
        return None
    if cfg.harness.partner == "expert":
        return f"{_key('harness.partner')} expert: the scripted partner plays deep search only"
    return None


def _sft_output_needed(cfg) -> bool:
    """Whether the warm start of ``train`` / ``eval`` may be (re)trained into ``sft.output_dir``."""
    return cfg.model.source not in ("dir", "base")


def _cache_error(cfg) -> str | None:
    from mosaic.envs.cache import cache_dir_error

    return cache_dir_error(cfg.data.cache_dir)


def sft_error(cfg) -> str | None:
    """``mosaic sft``: the base model, ``sft.data`` (when given) and ``sft.output_dir``."""
    return (family_error(cfg) or warm_start_error(cfg) or _cache_error(cfg)
            or (_input_file_error("sft.data", cfg.sft.data) if cfg.sft.data else None)
            or output_error(_key("sft.output_dir"), cfg.sft.output_dir, is_dir=True))


def _kinds_error(cfg) -> str | None:
    """``algo.count_kinds`` naming a kind the built-in harness never makes (a typo would count 0 sessions
    for every trajectory and silently switch the session-count term off)."""
    if not cfg.algo.count_kinds or cfg.rollout.source != "builtin":  # (a captured harness may register its own)
        return None
    from mosaic.trace.graph import KIND_CODES

    unknown = [k for k in cfg.algo.count_kinds if k not in KIND_CODES]
    return (f"{_key('algo.count_kinds')} unknown session kind(s) {unknown}; known: {sorted(KIND_CODES)}"
            if unknown else None)


def train_error(cfg) -> str | None:
    """``mosaic train``: ``train.run_dir``, the warm start's model and output, ``rollout.records``."""
    bad = (family_error(cfg) or output_error(_key("train.run_dir"), cfg.train.run_dir, is_dir=True)
           or warm_start_error(cfg) or _cache_error(cfg) or _kinds_error(cfg))
    if bad:
        return bad
    if cfg.rollout.source == "records":
        bad = _input_file_error("rollout.records", cfg.rollout.records, dir_ok=True)
    if not bad and _sft_output_needed(cfg):
        bad = ((_input_file_error("sft.data", cfg.sft.data) if cfg.sft.data else None)
               or output_error(_key("sft.output_dir"), cfg.sft.output_dir, is_dir=True))
    return bad


def train_notes(cfg) -> list[str]:
    """What ``mosaic train`` says before it starts about a config that runs but may not do what its name
    suggests: a session-credit estimator under ``harness.mode=single`` (one session per trajectory: no session
    term, as a grid's single-context setting compares on purpose), and reset mode from a base model that never
    saw it, and reset-only settings changed while the harness does not reset."""
    from mosaic.config.loader import load_config
    from mosaic.core.estimators import ESTIMATORS

    notes = []
    idle = cfg.harness.idle_reset_note(load_config(cfg.preset).harness)
    if idle:
        notes.append(idle)
    base = cfg.model.base or f"{cfg.model.embedded_preset}-base"
    if cfg.harness.resets and cfg.model.source == "base" and base == "tiny-base":
        notes.append("harness.mode=reset with model.base=tiny-base: that base never saw context resets (about 2 % "
                     "on validation at reset_k 4); model.base=tiny-base2 knows them (docs/models.md)")
    est = ESTIMATORS[cfg.algo.estimator]
    if cfg.harness.mode == "single" and (est.needs_gains or "downstream" in est.needs):
        extra = " (and algo.gain_reference=group has nothing to score)" if cfg.algo.gain_reference == "group" else ""
        notes.append(f"harness.mode=single makes one session per trajectory: {est.name}'s session term is 0 here "
                     f"(every session is final), so it trains on its trajectory term alone{extra}")
    return notes


def eval_error(cfg, checkpoint: str | None) -> str | None:
    """``mosaic eval``: the warm start's model when it is what gets evaluated (no ``--checkpoint``, no
    checkpoint in ``train.run_dir``)."""
    bad = family_error(cfg) or _cache_error(cfg)
    if bad or checkpoint:
        return bad
    from mosaic.train.checkpoint import find_latest

    if Path(cfg.train.run_dir).is_dir() and find_latest(cfg.train.run_dir) is not None:
        return None
    return warm_start_error(cfg) or (output_error(_key("sft.output_dir"), cfg.sft.output_dir, is_dir=True)
                                 if _sft_output_needed(cfg) else None)


def eval_notes(cfg, checkpoint: str | None, config_path: str | None = None) -> list[str]:
    """What ``mosaic eval`` says before it starts when the run it evaluates was trained with another harness
    (or task family) than the config given: the run's ``config.yaml`` is not read on its own, so a run
    trained with ``harness.mode=reset`` is evaluated under the preset's compaction unless told. When
    ``config_path`` (``--config``) is that very file, the differences are the user's own overrides: the note
    names them and gives no advice."""
    import yaml

    from mosaic.config.loader import config_diff, dump_config
    from mosaic.train.checkpoint import find_latest

    start = Path(checkpoint) if checkpoint else Path(cfg.train.run_dir)
    if not checkpoint and (not start.is_dir() or find_latest(start) is None):
        return []  # (the warm start is what gets evaluated)
    found = next((d / "config.yaml" for d in (start, *list(start.parents)[:3]) if (d / "config.yaml").is_file()), None)
    if found is None:
        return []
    try:
        text = found.read_text()
        run = yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):  # (ValueError: bytes that are not text)
        run = None
    if not isinstance(run, dict) or not isinstance(run.get("harness", {}), dict) \
            or not isinstance(run.get("data", {}), dict):
        return [f"{found}: unreadable as a config; cannot tell whether its run was trained with this harness"]
    # the resume check's diff; a key only one side has (a field added or removed since) is no difference
    differ = [line.split(": ", 1)[0] for line in config_diff(text, dump_config(cfg)) if "(absent)" not in line
              and line.startswith(("harness.", "data.family:"))]
    if not differ:
        return []
    shown = ", ".join(differ[:6]) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
    if config_path and Path(config_path).resolve() == found.resolve():
        return [f"this evaluation overrides {shown} of the run's own config ({found})"]
    return [f"the run in {found.parent} was trained with other values of {shown} than this evaluation uses; "
            f"to evaluate it as it was trained, pass --config {found}"]
