"""Mosaic next to the real verl 0.9.1: one environment with ``mosaic-rl[verl,dev]`` (``.venv-verl``).

``bench/_peers.py`` builds it on first use (torch first, pinned like the core env so pip never pulls
a CUDA build; then ``-c constraints-verl.txt -e .[verl,dev]``) and reuses it afterwards. These
tests then run pytest *inside* it:

- ``tests/integrations/verl``: the plugin against verl's registries, dispatchers, loss, agent-loop
  types and dataset class (default suite);
- ``tests/core``, ``tests/trace`` and the fast agent tests on verl's pinned transformers (< 5.11):
  our code must run on those versions too (slow: ``make slow``).

If the venv cannot be built they FAIL when ``CI`` is set and skip with the reason otherwise.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.peer
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def verl_py(peers):
    try:
        return peers.ensure_verl_venv()
    except Exception as exc:  # noqa: BLE001 - any build failure is reported the same way
        msg = f"verl venv unavailable: {exc}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def _pytest_in_venv(py: Path, *args: str, timeout: float = 1500) -> str:
    env = {**os.environ, "MOSAIC_VERL_ENV": "1", "VERL_USE_EXTERNAL_PLUGINS": "auto"}
    res = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=timeout)  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"pytest in .venv-verl failed ({res.returncode}):\n{out[-6000:]}"
    assert " passed" in out and " skipped" not in out, out[-3000:]
    return out


def test_versions_side_by_side(verl_py):
    code = ("import verl, transformers, tensordict, mosaic, mosaic.integrations.verl.plugin as p; "
            "assert p.LOAD_ERROR is None; print(verl.__version__, transformers.__version__, tensordict.__version__)")
    out = subprocess.run([str(verl_py), "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "0.9.1"
    major, minor = (int(x) for x in out[1].split(".")[:2])
    assert (major, minor) < (5, 11)  # verl's own pin: our code runs on it


def test_integration_suite_in_verl_env(verl_py):
    _pytest_in_venv(verl_py, "tests/integrations/verl")


@pytest.mark.slow
def test_verls_trainer_on_cpu_end_to_end(verl_py):
    """2 steps each of examples/verl/run_{mosaic,broadcast}_compaction.sh with DEVICE=cpu (test_cpu_e2e.py)."""
    _pytest_in_venv(verl_py, "-m", "slow", "tests/integrations/verl/test_cpu_e2e.py", timeout=3300)


@pytest.mark.slow
def test_core_trace_agent_suites_on_verls_transformers(verl_py):
    _pytest_in_venv(verl_py, "tests/core", "tests/trace", "tests/agent/test_chat_format.py",
                    "tests/agent/test_harness_records.py", "tests/agent/test_harness_caps.py",
                    "tests/agent/test_tokenizer_project.py", "tests/envs")  # fmt: skip
