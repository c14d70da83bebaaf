"""Peer environments for comparisons: verl lives in its own virtualenv.

verl 0.9.1 pins ``transformers<5.11`` and ``tensordict<=0.10``, incompatible
with the core environment, so it is installed into ``<repo>/.venv-verl``
(gitignored) on demand, with the exact pins of the ``verl`` extra in
pyproject.toml (torch first, pinned like the core env, so pip never pulls a
CUDA build). An existing venv is reused when ``verl.trainer.ppo.v1.utils``
imports in it.

Used by ``tests/peers/`` (which run verl in a subprocess) and by
``bench/advantages.py`` (which re-executes itself inside the venv).
"""

from __future__ import annotations

import sys
from pathlib import Path

from mosaic.integrations.peer_env import core_pin, ensure_venv, venv_python

REPO = Path(__file__).resolve().parent.parent
VERL_VENV = REPO / ".venv-verl"
_PROBE = "import verl, verl.trainer.ppo.core_algos, verl.trainer.ppo.v1.utils; print(verl.__version__)"


def verl_python() -> Path | None:
    """Path of the verl venv's python, if that venv exists and imports verl; else None."""
    return venv_python(VERL_VENV, _PROBE)


def ensure_verl_venv(log=sys.stderr) -> Path:
    """Return the verl venv's python, building the venv first if needed (~2-3 min).

    Raises RuntimeError (with pip's output tail) when the build fails.
    """
    return ensure_venv(REPO, "verl", "verl", _PROBE, first=(core_pin(REPO, "torch"),), log=log)
