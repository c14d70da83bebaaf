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

import fcntl
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VERL_VENV = REPO / ".venv-verl"
_PROBE = "import verl, verl.trainer.ppo.core_algos, verl.trainer.ppo.v1.utils; print(verl.__version__)"


def _pins() -> tuple[str, list[str]]:
    """(torch pin from the core deps, the ``verl`` extra's pins) from pyproject.toml."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch_pin = next(d for d in meta["dependencies"] if d.startswith("torch=="))
    return torch_pin, list(meta["optional-dependencies"]["verl"])


def verl_python() -> Path | None:
    """Path of the verl venv's python, if that venv exists and imports verl; else None."""
    py = VERL_VENV / "bin" / "python"
    if not py.exists():
        return None
    probe = subprocess.run([str(py), "-c", _PROBE], capture_output=True, text=True, timeout=300)
    return py if probe.returncode == 0 else None


def ensure_verl_venv(log=sys.stderr) -> Path:
    """Return the verl venv's python, building the venv first if needed (~2-3 min).

    Raises RuntimeError (with pip's output tail) when the build fails.
    """
    (REPO / ".cache").mkdir(exist_ok=True)  # gitignored
    with open(REPO / ".cache" / "venv-verl.lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        py = verl_python()
        if py is not None:
            return py
        torch_pin, verl_pins = _pins()
        print(f"building {VERL_VENV.name}: {torch_pin}, {' '.join(verl_pins)}", file=log, flush=True)
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(VERL_VENV)],
            [str(VERL_VENV / "bin" / "python"), "-m", "pip", "install", "-q", torch_pin],
            [str(VERL_VENV / "bin" / "python"), "-m", "pip", "install", "-q", *verl_pins],
        ]
        for cmd in steps:
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                tail = (res.stdout + res.stderr)[-3000:]
                raise RuntimeError(f"building the verl venv failed at {' '.join(cmd[:4])} ...:\n{tail}")
        py = verl_python()
        if py is None:
            raise RuntimeError(f"{VERL_VENV.name} was built but verl does not import in it")
        return py
