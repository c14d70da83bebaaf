"""Peer libraries for comparisons, each in a virtualenv of its own, built on demand.

Heavy peers (verl, deepagents) need versions the core environment does not
test with (verl 0.9.1: ``transformers<5.11``, ``tensordict<=0.10``), so the tests
and benchmarks that compare against them install a pyproject extra, held to the
exact versions of ``constraints-<name>.txt``, into ``<repo>/.venv-<name>``
(gitignored) and run the peer in a subprocess with that interpreter. A venv is reused when its probe import
succeeds; builders take a file lock so parallel test processes build once.
A development tool of the checkout (it reads its ``pyproject.toml``), not part
of the installed package.
``python bench/_peers.py deepagents|trl|verl`` builds (or finds) one and prints its python.

deepagents (:func:`ensure_deepagents_venv`): the ``deepagents`` extra under
``constraints-deepagents.txt`` (langchain and its providers would otherwise enter the core environment),
reused when ``deepagents`` + ``langchain_openai`` import; ``tests/capture`` drives it.

verl (:func:`ensure_verl_venv`): torch is installed first, pinned like the core env,
so pip never pulls a CUDA build; then this checkout itself, ``-e .[verl,dev]`` under
``constraints-verl.txt`` (Mosaic installed next to verl: the plugin's environment);
an existing venv is reused when verl, its v1 utilities and the Mosaic plugin import in it. Used by ``tests/peers/`` (which run
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
_PROBE = ("import verl, verl.trainer.ppo.core_algos, verl.trainer.ppo.v1.utils, mosaic.integrations.verl.plugin as p; "
          "assert p.LOAD_ERROR is None; print(verl.__version__)")
_TRL_PROBE = "import trl, datasets, accelerate, mosaic.integrations.trl.trainer; print(trl.__version__)"
_DEEPAGENTS_PROBE = ("import deepagents, langchain_openai; from deepagents.middleware.summarization import "
                     "SummarizationMiddleware; print(deepagents.__version__)")


def extra_pins(repo: Path, extra: str) -> list[str]:
    """The pins of ``[project.optional-dependencies].<extra>`` in ``repo``'s pyproject.toml."""
    meta = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    return list(meta["optional-dependencies"][extra])


def core_pin(repo: Path, package: str) -> str:
    """The exact version of ``package`` the core env is tested with (``constraints.txt``, e.g. ``torch==2.13.0``)."""
    for line in (repo / "constraints.txt").read_text().splitlines():
        if line.split("#")[0].strip().lower().startswith(f"{package.lower()}=="):
            return line.split("#")[0].strip()
    raise KeyError(f"{package} is not pinned in constraints.txt")


def venv_python(venv: Path, probe: str) -> Path | None:
    """The venv's python if it exists and ``probe`` (Python source) runs in it; else None."""
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    res = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=300)
    return py if res.returncode == 0 else None


def ensure_venv(repo: Path, name: str, extra: str, probe: str, *, first: tuple[str, ...] = (),
                editable: bool = False, log=sys.stderr, timeout: float = 1800) -> Path:
    """``<repo>/.venv-<name>``'s python, building the venv from ``extra`` if needed.

    The install is held to ``<repo>/constraints-<name>.txt`` when that file exists. ``first``:
    requirements installed before the extra (e.g. the core torch pin, so pip never pulls a CUDA
    build). ``editable``: install this checkout with the extra (``-e .[extra]``) instead of the
    extra's requirements alone. Raises RuntimeError with pip's output tail on failure.
    """
    venv = repo / f".venv-{name}"
    (repo / ".cache").mkdir(exist_ok=True)  # gitignored
    with open(repo / ".cache" / f"venv-{name}.lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        py = venv_python(venv, probe)
        if py is not None:
            return py
        pins = ["-e", f"{repo}[{extra}]"] if editable else extra_pins(repo, extra)
        constraints = repo / f"constraints-{name}.txt"
        held = ["-c", str(constraints)] if constraints.exists() else []
        print(f"building {venv.name}: {' '.join([*first, *held, *pins])}", file=log, flush=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        steps = [[sys.executable, "-m", "venv", "--clear", str(venv)]]
        steps += [[*pip, *first]] if first else []
        steps += [[*pip, *held, *pins]]
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
    return ensure_venv(REPO, "verl", "verl,dev", _PROBE, first=(core_pin(REPO, "torch"),), editable=True, log=log)


def ensure_deepagents_venv(log=sys.stderr) -> Path:
    """The deepagents venv's python, building the venv first if needed (about a minute)."""
    return ensure_venv(REPO, "deepagents", "deepagents", _DEEPAGENTS_PROBE, log=log)


def ensure_trl_venv(log=sys.stderr) -> Path:
    """The TRL venv's python (torch first, then this checkout ``-e .[trl]`` under ``constraints-trl.txt``),
    building it first if needed (~5-8 min on a loaded 2-core machine). Used by ``tests/integrations/trl``."""
    return ensure_venv(REPO, "trl", "trl", _TRL_PROBE, first=(core_pin(REPO, "torch"),), editable=True, log=log)


BUILDERS = {"deepagents": ensure_deepagents_venv, "trl": ensure_trl_venv, "verl": ensure_verl_venv}


if __name__ == "__main__":  # python bench/_peers.py deepagents|trl|verl: build (or find) the venv, print its python
    if len(sys.argv) != 2 or sys.argv[1] not in BUILDERS:
        sys.exit(f"usage: python bench/_peers.py {{{'|'.join(BUILDERS)}}}")
    print(BUILDERS[sys.argv[1]]())
