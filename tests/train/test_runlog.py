import json
import random

from mosaic.train.config import dump_config, load_config
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
                       "val/accuracy": 0.2, "val/accuracy_lo": 0.1, "val/accuracy_hi": 0.3})
        lg.log_samples(4, [{"question": "q", "text": "..."}])
    out = capsys.readouterr().out
    assert "step:4 - critic/score/mean:0.4" in out
    assert load_config(yaml_path=tmp_path / "config.yaml") == cfg
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for name in ("reward", "heldout_accuracy", "sessions_per_traj", "pos_gain_share"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000
    assert "Best held-out accuracy: 0.2" in (tmp_path / "summary.md").read_text()
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
