"""Peer libraries for comparisons, each in a virtualenv of its own, built on demand.

Heavy peers (verl, deepagents) pin versions the core environment cannot take
(verl 0.9.1: ``transformers<5.11``, ``tensordict<=0.10``), so the tests and
benchmarks that compare against them install the exact pins of a pyproject
extra into ``<repo>/.venv-<name>`` (gitignored) and run the peer in a
subprocess with that interpreter. A venv is reused when its probe import
succeeds; builders take a file lock so parallel test processes build once.
A development tool of the checkout (it reads its ``pyproject.toml``), not part
of the installed package.

deepagents (:func:`ensure_deepagents_venv`): the exact pins of the ``deepagents``
extra (langchain and its providers would otherwise enter the core environment),
reused when ``deepagents`` + ``langchain_openai`` import; ``tests/capture`` drives it.

verl (:func:`ensure_verl_venv`): torch is installed first, pinned like the core env,
so pip never pulls a CUDA build; an existing venv is reused when
``verl.trainer.ppo.v1.utils`` imports in it. Used by ``tests/peers/`` (which run
verl in a subprocess) and ``bench/advantages.py`` (which re-executes itself
inside the venv). Tests get this module from the ``peers`` fixture
(``tests/conftest.py`` loads it by path: ``bench`` is no package).
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
_DEEPAGENTS_PROBE = ("import deepagents, langchain_openai; from deepagents.middleware.summarization import "
                     "SummarizationMiddleware; print(deepagents.__version__)")


def extra_pins(repo: Path, extra: str) -> list[str]:
    """The pins of ``[project.optional-dependencies].<extra>`` in ``repo``'s pyproject.toml."""
    meta = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    return list(meta["optional-dependencies"][extra])


def core_pin(repo: Path, package: str) -> str:
    """The core dependency pin of ``package`` (e.g. ``torch==2.13.0``)."""
    meta = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    return next(d for d in meta["dependencies"] if d.startswith(f"{package}=="))


def venv_python(venv: Path, probe: str) -> Path | None:
    """The venv's python if it exists and ``probe`` (Python source) runs in it; else None."""
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    res = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=300)
    return py if res.returncode == 0 else None


def ensure_venv(repo: Path, name: str, extra: str, probe: str, *, first: tuple[str, ...] = (),
                log=sys.stderr, timeout: float = 1800) -> Path:
    """``<repo>/.venv-<name>``'s python, building the venv from ``extra``'s pins if needed.

    ``first``: requirements installed before the extra (e.g. the core torch pin, so pip
    never pulls a CUDA build). Raises RuntimeError with pip's output tail on failure.
    """
    venv = repo / f".venv-{name}"
    (repo / ".cache").mkdir(exist_ok=True)  # gitignored
    with open(repo / ".cache" / f"venv-{name}.lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        py = venv_python(venv, probe)
        if py is not None:
            return py
        pins = extra_pins(repo, extra)
        print(f"building {venv.name}: {' '.join([*first, *pins])}", file=log, flush=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        steps = [[sys.executable, "-m", "venv", "--clear", str(venv)]]
        steps += [[*pip, *first]] if first else []
        steps += [[*pip, *pins]]
        for cmd in steps:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if res.returncode != 0:
                raise RuntimeError(f"building {venv.name} failed at {' '.join(cmd[:5])} ...:\n"
                                   f"{(res.stdout + res.stderr)[-3000:]}")
        py = venv_python(venv, probe)
        if py is None:
            raise RuntimeError(f"{venv.name} was built but its probe import fails: {probe}")
        return py


def verl_python() -> Path | None:
    """Path of the verl venv's python, if that venv exists and imports verl; else None."""
    return venv_python(VERL_VENV, _PROBE)


def ensure_verl_venv(log=sys.stderr) -> Path:
    """Return the verl venv's python, building the venv first if needed (~2-3 min).

    Raises RuntimeError (with pip's output tail) when the build fails.
    """
    return ensure_venv(REPO, "verl", "verl", _PROBE, first=(core_pin(REPO, "torch"),), log=log)


def ensure_deepagents_venv(log=sys.stderr) -> Path:
    """The deepagents venv's python, building the venv first if needed (about a minute)."""
    return ensure_venv(REPO, "deepagents", "deepagents", _DEEPAGENTS_PROBE, log=log)
