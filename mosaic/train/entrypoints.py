"""What ``mosaic train | sft | eval`` call once the config is valid.

The RL loop, SFT and evaluation are integrated by the lead after the harness
lands; until then these raise :class:`NotImplementedError` with a message that
says what is missing. :func:`prepare_run` (run dir, resolved config, resume
point) is ready and is what the loop starts with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mosaic.train.config import Config, dump_config

__all__ = ["RunPlan", "prepare_run", "run_train", "run_sft", "run_eval"]


@dataclass(frozen=True)
class RunPlan:
    run_dir: Path
    resume_from: Path | None
    """Checkpoint to resume from (``train.resume``), or None for a fresh run."""
    config_yaml: str


def prepare_run(cfg: Config) -> RunPlan:
    """Resolve the resume point (fails loud on a bad ``train.resume`` path) and the run dir; writes nothing."""
    from mosaic.train.checkpoint import resolve_resume

    run_dir = Path(cfg.train.run_dir)
    return RunPlan(run_dir=run_dir, resume_from=resolve_resume(cfg.train.resume, run_dir),
                   config_yaml=dump_config(cfg))  # fmt: skip


def run_train(cfg: Config) -> int:
    raise NotImplementedError(
        "the RL training loop is not integrated yet (mosaic.train has config, checkpoints, run logging, "
        "the gain scorer and statistics; the loop lands with the harness integration)"
    )


def run_sft(cfg: Config) -> int:
    raise NotImplementedError("SFT warm start is not integrated yet (needs the scripted expert and the harness)")


def run_eval(cfg: Config, checkpoint: str | None, out: str | None) -> int:
    raise NotImplementedError("evaluation is not integrated yet (needs the harness); "
                              "`mosaic compare` works on outcome files already")
