"""The deepagents harness lives in its own virtualenv, ``<repo>/.venv-deepagents`` (gitignored).

Built on demand with the exact pins of pyproject's ``deepagents`` extra
(langchain and its providers would otherwise enter the core environment);
reused when it exists and ``deepagents`` + ``langchain_openai`` import in it.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-deepagents"
_PROBE = ("import deepagents, langchain_openai; from deepagents.middleware.summarization import "
          "SummarizationMiddleware; print(deepagents.__version__)")


def pins() -> list[str]:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(meta["optional-dependencies"]["deepagents"])


def venv_python() -> Path | None:
    py = VENV / "bin" / "python"
    if not py.exists():
        return None
    probe = subprocess.run([str(py), "-c", _PROBE], capture_output=True, text=True, timeout=300)
    return py if probe.returncode == 0 else None


def ensure_venv(log=sys.stderr) -> Path:
    """The venv's python, building the venv first if needed (about a minute); RuntimeError on failure."""
    (REPO / ".cache").mkdir(exist_ok=True)
    with open(REPO / ".cache" / "venv-deepagents.lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        py = venv_python()
        if py is not None:
            return py
        print(f"building {VENV.name}: {' '.join(pins())}", file=log, flush=True)
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(VENV)],
            [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", *pins()],
        ]
        for cmd in steps:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if res.returncode != 0:
                raise RuntimeError(f"building {VENV.name} failed at {' '.join(cmd[:5])} ...:\n"
                                   f"{(res.stdout + res.stderr)[-3000:]}")
        py = venv_python()
        if py is None:
            raise RuntimeError(f"{VENV.name} was built but deepagents does not import in it")
        return py
