"""The core installs alone: ``pip install mosaic-rl`` (no extra) into a fresh virtualenv imports the
estimators, the trace, the harness, the trainer and the verl plugin's entry module, and pulls none of
the extras' packages (plots, TensorBoard, servers). In ``make slow`` (8.6 min on a loaded 2-core machine)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS_ONLY = ("matplotlib", "tensorboard", "fastapi", "uvicorn", "httpx", "scipy")


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)


@pytest.mark.slow  # several minutes of pip (torch, transformers) into a fresh venv: `make slow`
@pytest.mark.timeout(1200)
def test_the_core_installs_alone_and_imports(tmp_path):
    env_dir = tmp_path / "core-venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(ROOT / "constraints.txt")]
    r = _run(pip + ["torch"])  # first, alone: its CPU build (see constraints.txt)
    assert r.returncode == 0, r.stderr[-2000:]
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ there
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "runs", "reports", "*.egg-info",
                                                               "__pycache__", ".pytest_cache", ".hypothesis"))
    r = _run(pip + [str(src)])
    assert r.returncode == 0, r.stderr[-2000:]
    probe = ("import importlib.util as u, mosaic.core.estimators, mosaic.core.loss, mosaic.trace, "
             "mosaic.agent.harness, mosaic.train.rl, mosaic.integrations.verl, mosaic.config.loader; "
             f"print(sorted(p for p in {EXTRAS_ONLY!r} if u.find_spec(p)))")
    r = _run([py, "-c", probe], cwd=tmp_path)  # not the checkout: the installed package
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"extras' packages in the core install: {r.stdout.strip()}"
    assert sys.executable != py
