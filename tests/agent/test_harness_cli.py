"""``mosaic rollout``: streams trajectories to JSONL and prints a summary (expert and local policies)."""

import pytest

from mosaic.cli import main
from mosaic.trace import read_jsonl


def test_rollout_expert_streams_jsonl(tmp_path, capsys):
    out = tmp_path / "ro.jsonl"
    rc = main(["rollout", "--policy", "expert", "--preset", "cpu", "--n-tasks", "6", "--group-size", "2",
               "--mode", "compaction", "--context-budget", "360", "--max-new-tokens", "64", "--noise", "off",
               "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--no-progress",
               "--save-tokenizer", str(tmp_path / "tok"), "--set", "max_total_turns=40"])
    assert rc == 0
    trajs = read_jsonl(out)
    assert len(trajs) == 12 and all(t.success for t in trajs)
    printed = capsys.readouterr().out
    assert "accuracy" in printed and "1.000" in printed and "end: answer" in printed
    assert (tmp_path / "tok" / "tokenizer.json").exists()
    # reuse the saved tokenizer, fork mode, noise override
    out2 = tmp_path / "ro2.jsonl"
    assert main(["rollout", "--policy", "expert", "--preset", "cpu", "--n-tasks", "4", "--mode", "fork",
                 "--tokenizer", str(tmp_path / "tok"), "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(out2), "--no-progress", "--set", "noise.wrong_query=0.5"]) == 0
    assert all(t.meta["forks"] >= 1 for t in read_jsonl(out2))


@pytest.mark.parametrize("argv, fragment", [
    (["--set", "bogus=1"], "--set bogus=1: unknown harness field 'bogus'"),
    (["--context-budget", "0"], "--context-budget 0: bad value (HarnessConfig.context_budget"),
    (["--set", "noise.wrong_query=abc"], "--set noise.wrong_query=abc: noise.wrong_query must be a number"),
    (["--set", "noise.wrong_query=nan"], "--set noise.wrong_query=nan: noise.wrong_query must be finite"),
    (["--set", "noise.wrong_query=2"], "--set noise.wrong_query=2: ExpertNoise.wrong_query: must be a rate"),
    (["--set", "noise.bogus=0.1"], "--set noise.bogus=0.1: unknown noise field 'bogus'"),
    (["--set", "max_depth=abc"], "--set max_depth=abc: bad value"),
    (["--set", "success_threshold=inf"], "--set success_threshold=inf: bad value (HarnessConfig.success"),
    (["--set", "noequals"], "--set expects KEY=VALUE"),
    (["--group-size", "0"], "--group-size must be >= 1, got 0"),
    (["--n-tasks", "-63"], "--n-tasks must be >= 1 (leave it out for all tasks), got -63"),
    (["--n-tasks", "0"], "--n-tasks must be >= 1 (leave it out for all tasks), got 0"),
    (["--seed", "-1"], "config key 'data.seed': must be in [0, 9223372036854775807] (got -1)"),  # (--seed is data.seed)
    (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--policy", "local"], "--policy local needs --model DIR"),
    (["--policy", "local", "--model", "{tmp}/missing"], "--model {tmp}/missing: neither 'smollm2' nor an existing"),
    (["--policy", "openai", "--base-url", "localhost:8000"], "--base-url localhost:8000: expected an http"),
    (["--tokenizer", "{tmp}/missing"], "--tokenizer {tmp}/missing: neither 'smollm2' nor an existing directory"),
    (["--cache-dir", "{tmp}/file.txt"], "--cache-dir {tmp}/file.txt: not a directory"),
    (["--save-tokenizer", "{tmp}/file.txt/tok"], "--save-tokenizer {tmp}/file.txt/tok: not a directory"),
    (["--out", "{tmp}"], "--out {tmp}: cannot write a file there"),
    (["--out", "{tmp}/file.txt/x.jsonl"], "--out {tmp}/file.txt/x.jsonl: cannot write a file there"),
    (["--out", "/proc/nope/r.jsonl"], "--out /proc/nope/r.jsonl: cannot write a file there"),
    (["--save-tokenizer", "/proc/nope"], "--save-tokenizer /proc/nope: cannot create the directory"),
    (["--policy", "local", "--model", "{tmp}", "--device", "bogus"], "--device 'bogus': not a torch device"),
    (["--policy", "local", "--model", "{tmp}", "--device", "cuda:99"], "--device 'cuda:99': no "),
])
def test_rollout_bad_arguments_exit_2_with_one_line_naming_the_flag(tmp_path, capsys, argv, fragment):
    # issue 11: `rollout --set noise.wrong_query=abc` and `--group-size 0` ended in tracebacks;
    # `--n-tasks -63` silently ran 1 task and `--n-tasks 0` ran all of them.
    (tmp_path / "file.txt").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    base = ["rollout", "--preset", "cpu", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "x.jsonl"),
            "--no-progress"]
    assert main(base + argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("mosaic rollout: ") and fragment.replace("{tmp}", str(tmp_path)) in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err + captured.out, err
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "cache").exists()  # before any work


def test_rollout_a_reset_budget_that_cannot_hold_a_session_is_a_config_error(tmp_path, capsys):
    out = tmp_path / "x.jsonl"
    assert main(["rollout", "--policy", "expert", "--preset", "cpu", "--mode", "reset", "--n-tasks", "2",
                 "--out", str(out), "--no-progress", "harness.reset_context_budget=300"]) == 2
    err = capsys.readouterr().err
    assert "mosaic rollout: config error: harness.reset_context_budget: a fresh reset session's prompt is" in err
    assert "Traceback" not in err and not out.exists()
    # --mode counts for the overrides that need it (two roles and a partner need mode=reset)
    assert main(["rollout", "--policy", "expert", "--preset", "cpu", "--mode", "reset", "--n-tasks", "2",
                 "--out", str(out), "--no-progress", 'harness.reset_roles=["a: search", "b: answer"]',
                 "harness.partner=expert"]) == 0
    assert main(["rollout", "--policy", "expert", "--preset", "cpu", "--mode", "reset", "--n-tasks", "2",
                 "--out", str(out), "--no-progress", "harness.max_new_tokens=300", "harness.reset_context_budget=300"]) == 2
    assert "config error: config key 'harness.max_new_tokens': must be < reset_context_budget" in capsys.readouterr().err


def test_rollout_notes_reset_only_settings_under_another_mode(tmp_path, capsys):
    """As mosaic train does: harness.reset_k under compaction runs and changes nothing, so it is said."""
    out = tmp_path / "x.jsonl"
    assert main(["rollout", "--policy", "expert", "--preset", "cpu", "--n-tasks", "2", "--out", str(out),
                 "--no-progress", "harness.reset_k=3", "harness.workspace_chars=400"]) == 0
    err = capsys.readouterr().err
    assert ("mosaic rollout: note: harness.reset_k, harness.workspace_chars only act under harness.mode=reset; "
            "with harness.mode=compaction they change nothing") in err
    assert main(["rollout", "--policy", "expert", "--preset", "cpu", "--mode", "reset", "--n-tasks", "2",
                 "--out", str(out), "--no-progress", "harness.reset_k=3"]) == 0
    assert "only act" not in capsys.readouterr().err


@pytest.mark.slow  # builds, saves and loads a model: ~20 s alone, minutes on a loaded machine
def test_rollout_local_model(tmp_path):
    embedded = pytest.importorskip("mosaic.agent.models.embedded")
    from _tiny import tiny_model

    model, tok = tiny_model(seed=0)
    embedded.save_model(model, tok, tmp_path / "model")
    out = tmp_path / "local.jsonl"
    assert main(["rollout", "--policy", "local", "--model", str(tmp_path / "model"), "--preset", "cpu",
                 "--n-tasks", "2", "--group-size", "2", "--mode", "compaction+fork", "--context-budget", "600",
                 "--max-new-tokens", "24", "--set", "max_total_turns=4", "--set", "summary_max_new_tokens=24",
                 "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--no-progress"]) == 0
    trajs = read_jsonl(out)
    assert len(trajs) == 4
    # an untrained model emits garbage: every turn is counted, nothing crashes
    assert all(t.meta["turns"] >= 1 for t in trajs)


@pytest.mark.slow  # an in-process server over a tiny model
def test_rollout_openai_policy(tmp_path):
    pytest.importorskip("mosaic.agent.server")
    from _tiny import tiny_model
    from mosaic.agent.server import create_app
    from mosaic.agent.tokenizer import save_tokenizer
    from mosaic.serving import ServerThread

    model, tok = tiny_model(seed=0)
    save_tokenizer(tok, tmp_path / "tok")
    out = tmp_path / "api.jsonl"
    with ServerThread(create_app(model, tok, batch_window_s=0.02)) as srv:
        assert main(["rollout", "--policy", "openai", "--base-url", srv.url, "--tokenizer", str(tmp_path / "tok"),
                     "--preset", "cpu", "--n-tasks", "2", "--group-size", "2", "--mode", "fork",
                     "--context-budget", "600", "--max-new-tokens", "16", "--set", "max_total_turns=3",
                     "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--no-progress"]) == 0
    trajs = read_jsonl(out)
    assert len(trajs) == 4 and all(t.end_reason != "policy_error" for t in trajs)
    assert all(t.meta["tokens_sampled"] > 0 for t in trajs)


@pytest.mark.parametrize("argv, fragment", [
    (["--n-tasks", "abc"], "mosaic rollout: argument --n-tasks: invalid int value: 'abc'"),
    (["--temperature", "warm"], "mosaic rollout: argument --temperature: invalid float value: 'warm'"),
    (["--policy", "bogus"], "mosaic rollout: argument --policy: invalid choice: 'bogus'"),
    (["--bogus-flag"], "mosaic rollout: unrecognized arguments: --bogus-flag"),
])
def test_rollout_argparse_errors_are_one_line(tmp_path, capsys, argv, fragment):
    # issue 11: argparse errors printed the whole usage block (5-14 lines) before the message.
    base = ["rollout", "--preset", "cpu", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "x.jsonl")]
    with pytest.raises(SystemExit) as exc:
        main(base + argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(fragment), captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err + captured.out
    assert "usage:" not in captured.err
    assert not (tmp_path / "x.jsonl").exists()
