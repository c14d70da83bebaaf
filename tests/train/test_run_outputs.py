"""What a run leaves for the tools users run (issue 33 items 8 and 9): the held-out accuracy of the warm
start and of the final model in TensorBoard and wandb, at step 0 and at the last step; ``train.logger`` as
a plain string, as verl takes it; the final model in Hugging Face's layout in the run directory, and
the sampling defaults in every saved model's ``generation_config.json``."""

from __future__ import annotations

import importlib.util
import json

import pytest

from mosaic.train import entrypoints, runlog
from mosaic.config.loader import ConfigError, load_config

from .conftest import save_tiny_base

TINY = [
    "model.source=embedded", "model.embedded_preset=tiny", "data.n_train_tasks=4", "data.n_eval_tasks=3",
    "harness.context_budget=320", "harness.max_new_tokens=8", "harness.summary_max_new_tokens=8",
    "harness.max_turns=3", "harness.max_sessions=3", "harness.max_total_turns=6", "harness.subagent_max_turns=2",
    "train.batch_tasks=2", "train.group_size=2", "train.plot_every=0", "optim.micro_batch_size=3",
    "train.eval_samples=2",
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory, TINY)


def test_a_plain_string_logger_is_a_one_item_list():
    assert load_config("cpu", overrides=["train.logger=console"]).train.logger == ("console",)
    assert load_config("cpu", overrides=["train.logger=[console,tensorboard]"]).train.logger == (
        "console", "tensorboard")
    with pytest.raises(ConfigError, match="each entry must be one of"):
        load_config("cpu", overrides=["train.logger=bogus"])


@pytest.fixture(scope="module")
def trained(base_dir, tmp_path_factory):
    """One tiny run (1 step) with TensorBoard and a stand-in wandb: (run dir, wandb's logged steps)."""
    logged: list[tuple[int, dict]] = []

    class FakeWandb:  # stands in for a wandb run (the package is optional and not installed here)
        def log(self, d, step):
            logged.append((step, dict(d)))

        def finish(self):
            pass

    real_find = importlib.util.find_spec
    d, cache = base_dir
    run = tmp_path_factory.mktemp("out") / "run"
    cfg = load_config("cpu", overrides=TINY + [f"data.cache_dir={cache}", "model.source=dir", f"model.path={d}",
                                               f"train.run_dir={run}", "train.steps=1", "train.eval_every=0",
                                               "train.logger=[tensorboard,wandb]", "rollout.temperature=0.9",
                                               "rollout.top_p=0.95", "train.eval_temperature=0.3"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else real_find(name, *a))
        mp.setattr(runlog, "init_wandb", lambda *a, **k: FakeWandb())
        assert entrypoints.run_train(cfg) == 0
    return run, logged


def test_heldout_accuracy_reaches_tensorboard_and_wandb_at_start_and_end(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, logged = trained
    key = "val-core/deepsearch-test/acc/mean@2"
    ev = EventAccumulator(str(run / "tb"))
    ev.Reload()
    assert key in ev.Tags()["scalars"], ev.Tags()["scalars"]
    points = {e.step: e.value for e in ev.Scalars(key)}
    res = json.loads((run / "result.json").read_text())
    assert points == pytest.approx({0: res["warm_start"]["accuracy"], 1: res["final"]["accuracy"]})
    for bound in ("ci_lo", "ci_hi"):
        assert [e.step for e in ev.Scalars(f"val-aux/deepsearch-test/acc/{bound}@2")] == [0, 1]
    got = {step: m[key] for step, m in logged if key in m}
    assert got == pytest.approx(points)
    assert [s for s, _ in logged] == sorted(s for s, _ in logged)  # wandb's steps never go back


def test_the_final_model_loads_with_the_auto_classes_and_carries_its_sampling(trained):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from mosaic.agent.tokenizer import CHECK_TEXTS
    from mosaic.train import setup

    run, _ = trained
    final = run / "final"
    tok = AutoTokenizer.from_pretrained(str(final), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(final), local_files_only=True, dtype=torch.float32).eval()
    ckpt_model, ckpt_tok = setup.load_policy(str(run / "checkpoints" / "ckpt-1" / "model"),
                                             device=torch.device("cpu"), dtype=torch.float32)
    for text in CHECK_TEXTS:  # the saved tokenizer, not the one the architecture's name suggests
        assert tok(text, add_special_tokens=False)["input_ids"] == ckpt_tok(text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ckpt_tok(CHECK_TEXTS[1], add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ckpt_model(ids).logits, rtol=0, atol=0)
    for d in (final, run / "checkpoints" / "ckpt-1" / "model"):
        g = GenerationConfig.from_pretrained(str(d))
        assert g.do_sample is True and g.temperature == pytest.approx(0.9) and g.top_p == pytest.approx(0.95)
        assert g.max_new_tokens == 8
        assert g.mosaic["evaluation"] == {"temperature": 0.3, "do_sample": True, "samples_per_question": 2,
                                          "split": "test"}
    assert not (run / "final.tmp").exists() and not (run / "final.old").exists()
