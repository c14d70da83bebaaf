import json
import random

from mosaic.config.loader import dump_config, load_config
from mosaic.train.metrics import rollout_metrics
from mosaic.train.runlog import RunLogger, format_console_line, read_metrics

from .trajs import compaction_chain, fork


def test_console_line_format():
    line = format_console_line(3, {"zeta": 1.0, "actor/pg_loss": -0.01234, "critic/score/mean": 0.5})
    assert line == "step:3 - critic/score/mean:0.5 - actor/pg_loss:-0.0123 - zeta:1"


def test_run_dir_contents_and_resume_truncation(tmp_path, capsys):
    cfg = load_config()
    with RunLogger(tmp_path, config_yaml=dump_config(cfg), total_steps=4, plot_every=2, title="t") as lg:
        for s in range(1, 5):
            lg.log(s, {"critic/score/mean": 0.1 * s, "session/per_traj": 2.0, "session/pos_gain_share/main": 0.5,
                       "val/accuracy": 0.2, "val/accuracy_lo": 0.1, "val/accuracy_hi": 0.3, "timing_s/update": 1.0})
        lg.log_samples(4, [{"question": "q", "text": "..."}])
    out = capsys.readouterr().out
    assert "step:4 - critic/score/mean:0.4" in out
    assert load_config(yaml_path=tmp_path / "config.yaml") == cfg
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for name in ("reward", "heldout_accuracy", "sessions_per_traj", "pos_gain_share"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000
    # Lines written under the pre-verl names (val/accuracy...) are read under verl's.
    assert "timing_s/update_actor" in read_metrics(tmp_path)[0] and "val/accuracy" not in read_metrics(tmp_path)[0]
    assert "Best held-out accuracy (val-core/deepsearch/acc/mean@1): 0.2 (95% CI 0.1-0.3)" in \
        (tmp_path / "summary.md").read_text()
    assert list((tmp_path / "tb").glob("events.*"))
    # Resume after a checkpoint at step 2: steps 3-4 are dropped, then re-logged once.
    with RunLogger(tmp_path, start_step=2, console=False, tensorboard=False) as lg:
        lg.log(3, {"critic/score/mean": 0.9})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert (tmp_path / "samples.jsonl").read_text() == ""


def test_rollout_metrics():
    rng = random.Random(0)
    trajs = [compaction_chain(rng, 2, tid="a"), fork(rng, tid="b")]
    trajs[0].end_reason, trajs[1].end_reason = "answer", "session_cap"
    gains = [0.5, -0.2, 0.1, 0.3, 0.0, 0.0, -1.0]  # a: main comp main comp main(final); b: main(final) sub
    m = rollout_metrics(trajs, gains=gains)
    assert m["critic/score/mean"] == 0.5 and m["session/per_traj"] == 3.5
    assert m["session/compactions"] == 1.0 and m["session/forks"] == 0.5
    assert m["session/pos_gain_share/main"] == 1.0 and m["session/pos_gain_share/compaction"] == 0.5
    assert m["session/pos_gain_share/subagent"] == 0.0 and m["session/gain/subagent"] == -1.0
    assert m["session/end/answer"] == 0.5
    json.dumps(m)


def test_logger_list_resolves_like_verl_and_old_switches_still_work():
    from mosaic.config.loader import ConfigError

    assert load_config().train.sinks() == ("console", "tensorboard")  # the old defaults, unchanged
    assert load_config(overrides=["train.wandb=offline", "train.tensorboard=false"]).train.sinks() == \
        ("console", "wandb")
    cfg = load_config(overrides=["train.logger=[console,wandb]", "train.project_name=p",
                                 "train.experiment_name=e"])
    assert cfg.train.sinks() == ("console", "wandb") and cfg.train.project_name == "p"
    for bad, key in ((["train.logger=[console,mlflow]"], "train.logger"),
                     (["train.logger=[console,console]"], "train.logger"),
                     (["train.logger=[console]", "train.wandb=offline"], "train.wandb"),
                     (["train.logger=[tensorboard]", "train.tensorboard=false"], "train.tensorboard")):
        try:
            load_config(overrides=bad)
        except ConfigError as exc:
            assert f"'{key}'" in str(exc), exc
        else:
            raise AssertionError(f"{bad} was accepted")


def test_wandb_sink_online_with_a_key_offline_without_or_when_unreachable(tmp_path, monkeypatch):
    import sys
    import types

    import pytest

    calls = []

    class Run:
        def log(self, *a, **k):
            calls.append(("log", a, k))

        def finish(self):
            calls.append(("finish",))

    def init(mode, **kw):
        calls.append(("init", mode, kw["project"], kw["name"]))
        if mode == "online" and fail_online:
            raise TimeoutError("no route to the server")
        return Run()

    fake = types.SimpleNamespace(init=init, api=types.SimpleNamespace(api_key=None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    fail_online = False
    with RunLogger(tmp_path / "a", logger=["wandb"], project_name="proj", experiment_name="exp") as lg:
        lg.log(1, {"critic/score/mean": 0.5})
    assert calls[0] == ("init", "offline", "proj", "exp") and calls[1][0] == "log"
    assert not (tmp_path / "a" / "tb").exists()  # tensorboard not listed
    calls.clear()
    monkeypatch.setenv("WANDB_API_KEY", "k")
    RunLogger(tmp_path / "b", logger=["wandb"]).close()
    assert calls[0] == ("init", "online", "mosaic", "b")
    calls.clear()
    fail_online = True
    with pytest.warns(UserWarning, match="logging offline"):
        RunLogger(tmp_path / "c", logger=["wandb"]).close()
    assert [c[1] for c in calls if c[0] == "init"] == ["online", "offline"]
    calls.clear()
    RunLogger(tmp_path / "e", wandb="offline", tensorboard=False).close()  # the deprecated switch: offline always
    assert [c[1] for c in calls if c[0] == "init"] == ["offline"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(RuntimeError, match="not installed"):
        RunLogger(tmp_path / "d", logger=["wandb"])


def test_rollout_metrics_split_successes_failures_and_groups():
    """The mechanism's metrics (issue 28 item 4): sessions for successes and failures apart, and how
    groups split by outcome (only mixed groups carry a trajectory advantage)."""
    rng = random.Random(0)
    # group g1: a success with 5 sessions and a failure with 3; group g2: two failures
    trajs = [compaction_chain(rng, 2, tid="a", reward=1.0), compaction_chain(rng, 1, tid="b", reward=0.0),
             compaction_chain(rng, 1, tid="c", reward=0.0), compaction_chain(rng, 3, tid="d", reward=0.0)]
    for t, g in zip(trajs, ["g1", "g1", "g2", "g2"]):
        t.group_id = g
    m = rollout_metrics(trajs)
    assert m["session/per_traj/success"] == 5.0 and m["session/per_traj/failure"] == (3 + 3 + 7) / 3
    assert m["session/count/compaction/success"] == 2.0 and m["session/count/compaction/failure"] == (1 + 1 + 3) / 3
    assert m["groups/mixed_share"] == 0.5 and m["groups/all_fail_share"] == 0.5 and m["groups/all_success_share"] == 0
    only_fail = rollout_metrics(trajs[2:])
    assert "session/per_traj/success" not in only_fail and only_fail["groups/all_fail_share"] == 1.0
