"""The service family through the trainer (issue 29 item 6): one RL step on the ``cpu-service`` preset logs
the family's outcome (stale-action rate and the rest) beside the usual metrics."""

import json

import pytest


def test_one_step_on_the_service_family_logs_its_outcome(tmp_path):
    from mosaic.config.loader import load_config
    from mosaic.train import entrypoints

    d = tmp_path / "run"
    cfg = load_config("cpu-service", overrides=[
        f"data.cache_dir={tmp_path / 'cache'}", "data.n_train_tasks=8", "train.steps=1", "train.batch_tasks=2",
        "train.group_size=2", "train.heldout_split=none", "train.tensorboard=false", f"train.run_dir={d}"])  # fmt: skip
    assert entrypoints.run_train(cfg) == 0
    m = json.loads((d / "metrics.jsonl").read_text().splitlines()[-1])
    for k in ("env/stale_rate", "env/stale_actions", "env/visits_correct", "env/state_match", "env/answer_correct"):
        assert k in m and 0 <= m[k] < 1e6, k
    sample = json.loads((d / "samples.jsonl").read_text().splitlines()[0])
    assert sample["task_id"].startswith("train-") or sample["task_id"]
    first = json.loads((d / "vocab.json").read_text())["pieces"]
    text = "".join(first[i] for i in sample["sessions"][0]["prompt"])
    assert "get_account" in text and "Visit 1 of" in text  # the family's tools and its first visit


def test_one_step_on_the_service_family_in_context_reset_mode(tmp_path):
    """Issue 30 item 4: ``harness.mode=reset`` on the service family through the trainer: every session is a
    ``reset`` session, the notes are in the samples, and Mosaic's estimator trains on them."""
    from mosaic.config.loader import load_config
    from mosaic.train import entrypoints

    d = tmp_path / "run"
    cfg = load_config("cpu-service", overrides=[
        f"data.cache_dir={tmp_path / 'cache'}", "data.n_train_tasks=8", "train.steps=1", "train.batch_tasks=2",
        "train.group_size=2", "train.heldout_split=none", "train.tensorboard=false", f"train.run_dir={d}",
        "harness.mode=reset", "harness.reset_k=4", "harness.max_turns=12", "algo.estimator=mosaic"])  # fmt: skip
    assert entrypoints.run_train(cfg) == 0
    m = json.loads((d / "metrics.jsonl").read_text().splitlines()[-1])
    assert "env/stale_rate" in m and m.get("session/count/reset", 0) >= 1, sorted(k for k in m if "count" in k)
    samples = [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]
    kinds = {s["kind"] for x in samples for s in x["sessions"]}
    assert kinds == {"reset"}, kinds


@pytest.mark.parametrize("mode", ["compaction", "reset"])
def test_eval_on_the_service_family_prints_its_outcome(tmp_path, capsys, mode):
    """``mosaic eval`` on the service family prints the stale-action rate and the visits handled right (the
    family's first-class metrics) in its result line and with the session statistics; in reset mode also
    the reset counters (``reset/*``, as training logs them)."""
    from mosaic.config.loader import load_config
    from mosaic.train import entrypoints

    cfg = load_config("cpu-service", overrides=[
        f"data.cache_dir={tmp_path / 'cache'}", "data.eval_split=validation", "data.n_eval_tasks=2",
        "train.eval_samples=1", "train.eval_temperature=0.5", f"train.run_dir={tmp_path / 'run'}",
        f"harness.mode={mode}"])  # fmt: skip
    assert entrypoints.run_eval(cfg, None, str(tmp_path / "outcomes.jsonl")) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "stale-action rate" in text and "visits handled right" in text, text[-2000:]
    import json

    rows = [json.loads(x) for x in (tmp_path / "outcomes.jsonl").read_text().splitlines()]
    assert rows and all(isinstance(r.get("env"), dict) and "reward" in r["env"] for r in rows)  # why it failed
    for k in ("env/stale_rate", "env/visits_correct", "env/answer_correct", "val-core/service/acc/mean@1"):
        assert f"  {k}: " in out.out, k
    assert "deepsearch" not in out.out  # (its accuracy once went by deep search's name)
    for k in ("reset/resets", "reset/notes_written", "reset/workspace_full"):
        assert (f"  {k}: " in out.out) == (mode == "reset"), k


def test_eval_line_says_na_for_a_stale_rate_over_no_account_changes():
    """A stale-action rate over zero mutating actions is no rate: the result line says so instead of 0.0 %."""
    from mosaic.train.evaluate import EvalResult

    base = {"env/stale_rate": 0.0, "env/visits_correct": 0.0}
    idle = EvalResult(0.0, 0.0, 0.1, 4, {**base, "env/actions": 0.0}).line()
    acted = EvalResult(0.5, 0.1, 0.9, 4, {**base, "env/stale_rate": 0.25, "env/actions": 2.0}).line()
    assert "stale-action rate n/a (no account changes)" in idle
    assert "stale-action rate 25.0 %" in acted and "n/a (no account" not in acted
    assert "stale" not in EvalResult(0.5, 0.1, 0.9, 4, {}).line()  # deep search: no such figures
    # single-session rollouts score no gain: the share is n/a, not "nan"
    assert "positive-gain share n/a" in EvalResult(0.5, 0.1, 0.9, 4, {}).line()
    assert "positive-gain share 0.40" in EvalResult(0.5, 0.1, 0.9, 4, {"session/pos_gain_share/all": 0.4}).line()
