"""Two training steps of verl's real trainer on CPU (runs in .venv-verl; slow: ``make slow``).

``examples/verl/run_mosaic_compaction.sh``, its broadcast twin, and the first with context resets and the
scripted partner (``++mosaic.harness.mode=reset ...``), with ``DEVICE=cpu``: ``python -m
verl.trainer.main_ppo`` (v1: Ray, TransferQueue, the ``mosaic_agent`` loop on the HF rollout server,
the FSDP2 actor on gloo, weight sync after each step) on the shipped model. The metrics must reach
verl's logger (its ``file`` backend, JSON lines) for both steps, with the Mosaic estimator's own rows,
rollout and actor log-probs in agreement, and a gradient step taken. 3-5 minutes per run here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.peer]
REPO = Path(__file__).resolve().parents[3]


def _train(script: str, tmp_path: Path, *extra: str) -> tuple[list[dict], str]:
    log = tmp_path / "metrics.jsonl"
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "DEVICE": "cpu", "STEPS": "2", "DATA": str(tmp_path / "data"), "PYTHON": sys.executable,
           "PATH": f"{bindir}:{os.environ.get('PATH', '')}", "VERL_FILE_LOGGER_PATH": str(log), "RAY_DEDUP_LOGS": "0"}
    res = subprocess.run(["bash", str(REPO / "examples/verl" / script), *extra], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=1500)  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return steps, out


def _finite(d: dict, key: str) -> float:
    assert key in d, f"{key} missing from verl's logged metrics: {sorted(d)[:40]}"
    v = float(d[key])
    assert math.isfinite(v), (key, v)
    return v


RESET = ("++mosaic.harness.mode=reset", "+mosaic.harness.reset_k=2", "+mosaic.harness.partner=expert",
         '+mosaic.harness.reset_roles=["searcher: search and note","solver: use the notes, answer"]')


@pytest.mark.parametrize("script,estimator,extra", [("run_mosaic_compaction.sh", "mosaic", ()),
                                                    ("run_broadcast_compaction.sh", "broadcast", ()),
                                                    ("run_mosaic_compaction.sh", "mosaic", RESET)])  # fmt: skip
def test_two_steps_through_verls_trainer_on_cpu(script, estimator, extra, tmp_path):
    """The third case: context resets, two roles, the scripted expert as the partner (its rows masked)."""
    steps, out = _train(script, tmp_path, *extra)
    assert [s["step"] for s in steps] == [1, 2], out[-3000:]
    for s in steps:
        d = s["data"]
        for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean"):
            _finite(d, key)
        adv_std, grad = _finite(d, "critic/advantages/std"), _finite(d, "actor/grad_norm")
        if estimator == "mosaic":  # gains were scored on the rollout server (prompt log-probs) and give
            assert any(k.startswith("session/pos_gain_share/") for k in d), sorted(d)  # every step a signal
            assert adv_std > 0 and grad > 0
        else:  # broadcast: a signal only when the group's rewards differ (the base model often scores 0)
            assert not any(k.startswith("session/pos_gain_share/") for k in d)
            spread = _finite(d, "critic/score/max") > _finite(d, "critic/score/min")
            assert (adv_std > 0 and grad > 0) if spread else (adv_std == 0 and grad == 0)
        # the HF rollout server's log-probs are the FSDP actor's
        assert _finite(d, "training/rollout_actor_probs_pearson_corr") > 0.99
        # every trajectory was sampled with the weights of the step before (the server's weight version
        # comes with each weight sync: a failed sync would show as staleness 1 at step 2)
        assert _finite(d, "training/off_policy/trajectory_staleness_worst/max") == 0
        assert _finite(d, "num_turns/mean") >= 3  # multi-turn agent trajectories, one row per session
        assert _finite(d, "mosaic/verl_minibatches") == 1  # one optimizer step per step, as in mosaic train
    assert "Training Progress: 100%" in out
