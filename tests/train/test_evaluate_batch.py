"""``evaluate``: the decode batch (``rollout.eval_batch_size``), gains scored live off the policy's cache equal
to the same gains scored after the rollouts."""

from __future__ import annotations

import pytest
import torch

from mosaic.train import evaluate as ev, setup
from mosaic.config.loader import ConfigError, load_config

SHORT = ["harness.mode=compaction", "harness.context_budget=384", "harness.max_turns=4", "harness.max_total_turns=6",
         "data.n_eval_tasks=4"]


@pytest.fixture(scope="module")
def shipped():
    model, tok = setup.load_policy(setup.base_model_dir("tiny"), device=torch.device("cpu"), dtype=torch.float32)
    return model, tok, setup.chat_format(tok)


def _eval(shipped, monkeypatch, overrides):
    model, tok, chat = shipped
    cfg = load_config("cpu", overrides=SHORT + overrides)
    sizes = []
    make = ev.sampling_policy

    def spy(*a, **k):
        sizes.append(k.get("batch_size"))
        return make(*a, **k)

    monkeypatch.setattr(ev, "sampling_policy", spy)
    r = ev.evaluate(cfg, model, tok, chat, setup.load_split(cfg, "test"), n_tasks=4, samples=3, temperature=0.5,
                    seed=3, progress=False)
    return r, sizes[0]


def test_live_gains_equal_gains_scored_after(shipped, monkeypatch):
    live, n_live = _eval(shipped, monkeypatch, ["algo.score_live=true"])
    after, n_after = _eval(shipped, monkeypatch, ["algo.score_live=false"])
    assert n_live == n_after == 64  # rollout.batch_size
    assert live.outcomes == after.outcomes  # the same rollouts
    keys = [k for k in after.metrics if k.startswith(("session/gain", "session/pos_gain_share"))]
    assert keys
    for k in keys:
        assert live.metrics[k] == pytest.approx(after.metrics[k], abs=1e-4), k


def test_eval_batch_size_is_used_and_validated(shipped, monkeypatch):
    _, n = _eval(shipped, monkeypatch, ["rollout.eval_batch_size=5", "algo.score_live=false"])
    assert n == 5
    with pytest.raises(ConfigError):
        load_config("cpu", overrides=["rollout.eval_batch_size=-1"])
