import json
from pathlib import Path

import pytest

from mosaic.cli import main


def test_config_error_exits_2_before_work(tmp_path, capsys):
    rd = tmp_path / "run"
    assert main(["train", "algo.lamda=0.2", f"train.run_dir={rd}"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'algo.lamda' (did you mean 'algo.lam'?)" in err
    assert not rd.exists()
    assert main(["sft", "--preset", "nope"]) == 2
    assert main(["eval", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert main(["train", "train.resume=" + str(tmp_path / "no-ckpt")]) == 2


def test_print_config(tmp_path, capsys):
    y = tmp_path / "c.yaml"
    y.write_text("algo:\n  estimator: broadcast\n")
    assert main(["train", "--config", str(y), "--preset", "paper", "--print-config", "algo.lam=0.3"]) == 0
    out = capsys.readouterr().out
    assert "preset: paper" in out and "estimator: broadcast" in out and "lam: 0.3" in out


def test_sft_and_eval_config_errors_do_no_work(tmp_path, capsys):
    rd = tmp_path / "r"
    assert main(["eval", "--preset", "cpu", "optim.lr=-1", f"train.run_dir={rd}"]) == 2
    assert "config key 'optim.lr': must be > 0" in capsys.readouterr().err
    assert not rd.exists()


def test_compare(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"question_id": f"q{i}", "correct": i % 2 == 0}) + "\n" for i in range(40)))
    b.write_text("".join(json.dumps({"question_id": f"q{i}", "correct": i % 4 == 0}) + "\n" for i in range(40)))
    assert main(["compare", str(a), str(b), "--n-boot", "2000", "--name-a", "mosaic", "--name-b", "grpo"]) == 0
    out = capsys.readouterr().out
    assert "difference (mosaic - grpo): 25.00 points" in out
    assert main(["compare", str(a), str(b), "--json", "--n-boot", "500"]) == 0
    assert json.loads(capsys.readouterr().out)["diff"] == 0.25
    assert main(["compare", str(a), str(tmp_path / "missing.jsonl")]) == 2
    (tmp_path / "bin.jsonl").write_bytes(b"\x8e\x00\xff binary")
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "bin.jsonl"), str(b)]) == 2
    assert f"{tmp_path / 'bin.jsonl'}: not UTF-8 text (byte 0)" in capsys.readouterr().err


def test_eval_and_compare_bad_flags_exit_2_with_one_line(tmp_path, capsys):
    # issue 11: `eval --checkpoint /missing` ended in a traceback.
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [
        (["eval", "--checkpoint", str(tmp_path / "missing")], f"--checkpoint {tmp_path / 'missing'}: no such directory"),
        (["eval", "--checkpoint", str(tmp_path / "file.txt")], "not a directory"),
        (["eval", "--checkpoint", str(tmp_path / "empty")], "neither a checkpoint, a model directory nor a run dir"),
        (["eval", "--out", str(tmp_path / "file.txt" / "o.jsonl")], "--out "),
        (["eval", "--out", "/proc/nope/o.jsonl"], "--out /proc/nope/o.jsonl: cannot write a file there"),
        (["pretrain", "--out", "/proc/nope"], "--out /proc/nope: cannot create the directory"),
        (["compare", str(tmp_path / "missing.jsonl"), str(tmp_path / "file.txt")], "outcome file a ("),
        (["compare", str(tmp_path / "file.txt"), str(tmp_path / "empty")], "outcome file b (") ,
        (["compare", str(tmp_path / "file.txt"), str(tmp_path / "file.txt"), "--n-boot", "0"], "--n-boot must be in [1, 10000000]"),
        (["compare", str(tmp_path / "file.txt"), str(tmp_path / "file.txt"), "--ci", "2"], "--ci must be in (0, 1)"),
    ]
    for argv, fragment in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)


def test_eval_checkpoint_that_does_not_verify_is_named(tmp_path, capsys):
    import torch

    from mosaic.train import checkpoint as ck

    d = ck.save_checkpoint(tmp_path / "run", 1, model=torch.nn.Linear(2, 2))
    (d / "model" / "model.safetensors").write_bytes(b"\xff" * (d / "model" / "model.safetensors").stat().st_size)
    assert main(["eval", "--checkpoint", str(d)]) == 2
    err = capsys.readouterr().err
    assert "not a usable checkpoint: corrupt safetensors header in model.safetensors" in err
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 2  # its only checkpoint is skipped
    assert "skipping" in capsys.readouterr().err


@pytest.mark.parametrize("content, fragment", [
    (b"\xff\xfe\x00a: 1\n", "is not UTF-8 text (byte 0: b'\\xff')"),
    (b"algo:\n  lam: [1, 2\nfoo: bar\n", "is not valid YAML: expected ',' or ']', but got ':' at line 3, column 4"),
    (b"- just\n- a list\n", "must hold a mapping of sections"),
])
@pytest.mark.parametrize("verb", ["train", "sft", "eval"])
def test_config_file_that_cannot_be_read_is_one_line(tmp_path, capsys, content, fragment, verb):
    # issue 11: binary bytes in --config ended in a UnicodeDecodeError traceback; invalid YAML printed
    # PyYAML's 8-line message.
    y = tmp_path / "c.yaml"
    y.write_bytes(content)
    assert main([verb, "--config", str(y)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"mosaic {verb}: config error: config file {str(y)!r} ")
    assert fragment in captured.err, captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err + captured.out


def test_config_override_with_invalid_yaml_is_one_line(capsys):
    assert main(["train", "algo.lam=[1,"]) == 2
    err = capsys.readouterr().err
    assert "config key 'algo.lam': value '[1,' is not valid YAML: " in err and "line 1, column 4" in err
    assert len(err.strip().splitlines()) == 1, err


def test_compare_mismatch_suggests_the_cli_flag(tmp_path, capsys):
    # issue 11: the message suggested on_mismatch='intersect' (the library keyword), not --intersect.
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"question_id": f"q{i}", "correct": True}) + "\n" for i in range(4)))
    b.write_text("".join(json.dumps({"question_id": f"q{i}", "correct": False}) + "\n" for i in range(1, 5)))
    assert main(["compare", str(a), str(b), "--n-boot", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mosaic compare: ") and "pass --intersect to compare the common ones" in err, err
    assert "on_mismatch" not in err and len(err.strip().splitlines()) == 1
    assert main(["compare", str(a), str(b), "--n-boot", "10", "--intersect"]) == 0


def test_train_notes_a_session_credit_estimator_without_sessions():
    """``harness.mode=single`` with an estimator whose session term reads gains or downstream credit runs (a
    grid's single-context setting compares it on purpose) but says that its session term is 0 there."""
    from mosaic.config.loader import load_config
    from mosaic.train.preflight import train_notes

    for est in ("mosaic", "mosaic-dag"):
        notes = train_notes(load_config("cpu", overrides=["harness.mode=single", f"algo.estimator={est}"]))
        assert len(notes) == 1 and f"{est}'s session term is 0" in notes[0]
    assert train_notes(load_config("cpu", overrides=["harness.mode=single", "algo.estimator=grpo"])) == []
    assert train_notes(load_config("cpu", overrides=["algo.estimator=mosaic-dag", "harness.mode=fork"])) == []


def test_train_notes_reset_mode_from_a_base_that_never_saw_it():
    from mosaic.config.loader import load_config
    from mosaic.train.preflight import train_notes

    (note,) = train_notes(load_config("cpu", overrides=["harness.mode=reset"]))
    assert "model.base=tiny-base2 knows them" in note
    assert train_notes(load_config("cpu", overrides=["harness.mode=reset", "model.base=tiny-base2"])) == []
    # reset-only knobs outside reset mode run and do nothing: said, not refused (reset_roles / partner are refused)
    (note,) = train_notes(load_config("cpu", overrides=["harness.mode=compaction", "harness.reset_k=2"]))
    assert note.startswith("harness.reset_k only acts under harness.mode=reset") and "mode=compaction" in note
    assert train_notes(load_config("cpu-service", overrides=["harness.mode=compaction"])) == []  # its preset's own


def test_eval_notes_a_run_trained_in_another_harness(tmp_path, monkeypatch):
    """``mosaic eval`` does not read a run's config.yaml on its own: it says when the run it evaluates was
    trained with another harness or family, and how to evaluate it as it was trained."""
    from mosaic.config.loader import dump_config, load_config
    from mosaic.train import checkpoint
    from mosaic.train.preflight import eval_notes

    run = tmp_path / "r"
    (run / "checkpoints" / "ckpt-2").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(load_config("cpu", overrides=["harness.mode=reset"])))
    cfg = load_config("cpu", overrides=[f"train.run_dir={run}"])
    assert eval_notes(cfg, None) == []  # no finished checkpoint there: the warm start is evaluated
    monkeypatch.setattr(checkpoint, "find_latest", lambda d: Path(d) / "checkpoints" / "ckpt-2")
    (note,) = eval_notes(cfg, None)
    assert "harness.mode" in note and f"--config {run / 'config.yaml'}" in note
    assert eval_notes(cfg, str(run / "checkpoints" / "ckpt-2")) == [note]
    same = load_config("cpu", overrides=["harness.mode=reset", f"train.run_dir={run}"])
    assert eval_notes(same, None) == []
    # --config RUN/config.yaml with an override on top: the override is the user's own, named without advice
    (given,) = eval_notes(cfg, None, str(run / "config.yaml"))
    assert given.startswith("this evaluation overrides harness.mode") and "--config" not in given
    assert eval_notes(load_config("cpu", overrides=[f"train.run_dir={tmp_path / 'none'}"]), None) == []
    for bad in ("harness: [unclosed", "- a list", "harness: 3"):
        (run / "config.yaml").write_text(bad)
        assert "unreadable as a config" in eval_notes(cfg, None)[0]
    (run / "config.yaml").write_bytes(b"\xff\xfe\x00bin")  # not text
    assert "unreadable as a config" in eval_notes(cfg, None)[0]
