"""Fixtures of the TRL tests: the TRL venv, one recorded batch, and runs of ``runner.py`` in that venv.

The venv (``<repo>/.venv-trl``) is built on first use by ``bench/_peers.py``; if it cannot be built
the tests that need it FAIL when ``CI`` is set and skip with the reason otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mosaic.serving import bind

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def trl_python(peers) -> Path:
    try:
        return peers.ensure_trl_venv()
    except Exception as exc:  # noqa: BLE001 - any build failure is reported the same way
        msg = f"TRL peer venv unavailable: {exc}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def recorded(tmp_path_factory) -> Path:
    """3 training questions x 4 samples of the shipped base model through the built-in harness."""
    from _record import record

    return record(tmp_path_factory.mktemp("recorded") / "batch.jsonl", tasks=3, group=4)


def _free_port() -> int:
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


@pytest.fixture(scope="session")
def trl_run(trl_python, recorded, tmp_path_factory):
    """``run(processes, scope, capo) -> out_dir``: one TRL step on the recorded batch (cached per arguments)."""
    done: dict[tuple[int, str, bool], Path] = {}

    def run(processes: int, scope: str = "global", capo: bool = False) -> Path:
        if (processes, scope, capo) in done:
            return done[(processes, scope, capo)]
        out = tmp_path_factory.mktemp(f"trl-{processes}-{scope}" + ("-capo" if capo else ""))
        script = [str(HERE / "runner.py"), str(recorded), str(out), "--scope", scope] + (["--capo"] if capo else [])
        if processes == 1:
            cmd = [str(trl_python), *script]
        else:  # accelerate's --cpu launches one process; --multi_gpu runs torchrun, use_cpu=True makes it gloo
            cmd = [str(trl_python.parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(processes),
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(_free_port()), *script]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env |= {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
        assert res.returncode == 0, f"TRL runner failed ({processes} processes, {scope}):\n{res.stderr[-4000:]}"
        done[(processes, scope, capo)] = out
        return out

    return run


@pytest.fixture(scope="session")
def base_params() -> dict[str, torch.Tensor]:
    """The shipped base model's parameters (what every run starts from)."""
    from mosaic.train import setup
    from mosaic.config.loader import load_config

    model, _ = setup.build_base_model(load_config("cpu"), torch.device("cpu"), torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
