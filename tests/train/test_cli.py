import json

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
