"""``mosaic proxy serve|export``: bad arguments and bad records (issue 11).

Bad flags exit with status 2 and one line naming the flag, before any work; in ``export`` a record
with a bad field (a reward of ``"abc"``, ``prompt_ids: "abc"``) is skipped with its rollout and a
warning naming ``file:line`` and the field, and nothing is written that the readers reject.
"""

from __future__ import annotations

import json
import socket

import pytest

from mosaic.capture.records import CallRecord, RecordWriter, RewardRecord
from mosaic.cli import main
from mosaic.trace import load_trajectories


def _records(path, n=3):
    w = RecordWriter(path)
    for i in range(n):
        w.write(CallRecord(call_id=f"c{i}", rollout_id=f"r{i}", seq=i, endpoint="completions", prompt_ids=[1, 2, 3],
                           completion_ids=[4, 5], logprobs=[-0.1, -0.2], t_start=float(i)))
        w.write(RewardRecord(rollout_id=f"r{i}", reward=1.0, ground_truth="x"))
    w.close()
    return path


def _corrupt(path, line, field, value):
    """Set ``field`` of the record on (1-based) ``line`` to ``value``, as another tool might write it."""
    lines = path.read_text().splitlines()
    obj = json.loads(lines[line - 1])
    obj[field] = value
    lines[line - 1] = json.dumps(obj)
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("argv, fragment", [
    (["--port", "-1"], "--port must be in [0, 65535] (0: any free port), got -1"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--port", "{busy}"], "--host 127.0.0.1 --port {busy}: cannot bind"),
    (["--timeout", "0"], "--timeout must be a finite number > 0, got 0.0"),
    (["--timeout", "nan"], "--timeout must be a finite number > 0, got nan"),
    (["--max-body-mb", "-1"], "--max-body-mb must be a finite number > 0"),
    (["--max-body-mb", "inf"], "--max-body-mb must be a finite number > 0, got inf"),
    (["--retries", "-1"], "--retries must be >= 0, got -1"),
    (["--tokenizer", "{tmp}/missing"], "--tokenizer {tmp}/missing: no such directory"),
    (["--out", "{tmp}/file.txt"], "--out {tmp}/file.txt: not a directory"),
    (["--out", "/proc/nope"], "--out /proc/nope: cannot create the directory"),
    (["--upstream", "localhost:8000"], "--upstream localhost:8000: expected an http:// or https:// URL"),
    (["--api-key-env", "MOSAIC_TEST_SURELY_UNSET_VAR"], "--api-key-env MOSAIC_TEST_SURELY_UNSET_VAR: environment"),
])
@pytest.mark.parametrize("verb", [["proxy", "serve"], ["proxy"]])
def test_proxy_serve_bad_arguments_exit_2_with_one_line(tmp_path, capsys, busy_port, argv, fragment, verb):
    # issue 11: `proxy serve --port -1` ended in a traceback.
    (tmp_path / "file.txt").write_text("x")
    subs = {"{tmp}": str(tmp_path), "{busy}": str(busy_port)}

    def fill(a):
        for k, v in subs.items():
            a = a.replace(k, v)
        return a

    base = [*verb, "--upstream", "http://127.0.0.1:9", "--out", str(tmp_path / "rec")]
    assert main(base + [fill(a) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("mosaic proxy serve: ") and fill(fragment) in captured.err, captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "rec").exists()  # before any work


@pytest.mark.parametrize("argv, fragment", [
    (["--records", "{tmp}/missing"], "--records {tmp}/missing: no such file or directory"),
    (["--records", "{tmp}/empty"], "--records {tmp}/empty: no *.jsonl record files in this directory"),
    (["--out", "{tmp}/s.csv"], "--out {tmp}/s.csv: use a .jsonl or .parquet file"),
    (["--out", "{tmp}/file.txt/s.jsonl"], "--out {tmp}/file.txt/s.jsonl: cannot write a file there"),
    (["--out", "{tmp}/dir.jsonl"], "--out {tmp}/dir.jsonl: cannot write a file there"),
    (["--out", "/proc/nope/x.jsonl"], "--out /proc/nope/x.jsonl: cannot write a file there"),
    (["--tokenizer", "{tmp}/missing"], "--tokenizer {tmp}/missing: no such directory"),
    (["--rule", "bogus=1"], "--rule 'bogus': unknown rule"),
    (["--rule", "noequals"], "--rule 'noequals': expected KEY=VALUE"),
    (["rules.include_unrewarded=maybe"], "rule 'rules.include_unrewarded': must be true or false (got 'maybe')"),
    (["rules.success_threshold=nan"], "rule 'rules.success_threshold': must be a finite number"),
    (["--records", "{tmp}/broken.jsonl"], "--records {tmp}/broken.jsonl: {tmp}/broken.jsonl:1: corrupted line"),
    (["--records", "{tmp}/foreign.jsonl"], "{tmp}/foreign.jsonl:1: not a Mosaic capture record"),
])
def test_proxy_export_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, fragment):
    # issue 11: `proxy export --records /missing` ended in a traceback.
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "broken.jsonl").write_text("{not json\n{}\n")
    (tmp_path / "foreign.jsonl").write_text('{"schema": "other"}\n')
    _records(tmp_path / "good.jsonl")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    base = ["proxy", "export", "--records", str(tmp_path / "good.jsonl"), "--out", str(tmp_path / "s.jsonl")]
    assert main(base + argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("mosaic proxy export: ") and fragment.replace("{tmp}", str(tmp_path)) in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "s.jsonl").exists()


@pytest.mark.parametrize("line, field, value, says", [
    (2, "reward", "abc", "reward record field 'reward': must be a number, got 'abc'"),
    (2, "reward", 3, "reward record field 'reward': 3.0 is not a number in [0, 1]"),
    (2, "reward", True, "reward record field 'reward': must be a number, got True"),
    (2, "ground_truth", 5, "reward record field 'ground_truth': must be a string, got 5"),
    (1, "prompt_ids", "abc", "call record field 'prompt_ids': must be a list, got 'abc'"),
    (1, "prompt_ids", [1, 2.5], "call record field 'prompt_ids[1]': must be an integer, got 2.5"),
    (1, "completion_ids", [-4], "call record field 'completion_ids[0]': token id -4 is outside [0, 2147483647]"),
    (1, "logprobs", [-0.1, 3.0], "call record field 'logprobs[1]': log-prob 3.0 is not finite and <= 0"),
    (1, "t_start", "x", "call record field 't_start': must be a number, got 'x'"),
    (1, "t_end", None, "call record field 't_end': must be a number, got None"),
    (1, "t_first", "soon", "call record field 't_first': must be a number, got 'soon'"),
    (1, "status", "200", "call record field 'status': must be an integer, got '200'"),
])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_skips_a_bad_record_with_its_rollout_naming_file_and_line(tmp_path, capsys, line, field, value, says,
                                                                          suffix):
    # issue 11: one bad reward aborted the whole export with a traceback and no file:line, and
    # `prompt_ids: "abc"` was exported into a file the project's own reader rejects.
    rec = _records(tmp_path / "records.jsonl")
    _corrupt(rec, line, field, value)  # rollout r0's call (line 1) or reward (line 2)
    out = tmp_path / f"s{suffix}"
    assert main(["proxy", "export", "--records", str(rec), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"warning: {rec}:{line}: {says} (skipped with rollout 'r0')" in captured.err, captured.err
    assert f"{rec}: dropped 1 rollout(s) (bad_record 1): 'r0' bad_record ({rec}:{line}: {says}" in captured.err
    assert "Traceback" not in captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["bad_records"] == 1 and summary["rollouts"] == 2 and summary["dropped"] == {"bad_record": 1}
    assert [t.id for t in load_trajectories(out)] == ["r1", "r2"]  # the rest is exported, and reads back


def _exit_code(argv):
    """``main(argv)``'s exit status, whether returned or raised (argparse errors raise SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("argv, fragment", [
    (["proxy", "serve", "--upstream", "http://127.0.0.1:9", "--out", "{tmp}/rec", "--log-level", "bogus"],
     "mosaic proxy serve: argument --log-level: invalid choice: 'bogus'"),
    (["proxy", "scripted-upstream", "--port", "-1"], "mosaic proxy scripted-upstream: --port must be in [0, 65535]"),
    (["proxy", "scripted-upstream", "--port", "70000"], "mosaic proxy scripted-upstream: --port must be in [0, 65535]"),
    (["proxy", "scripted-upstream", "--port", "0", "--tokenizer", "{tmp}/missing"],
     "mosaic proxy scripted-upstream: --tokenizer {tmp}/missing: no such directory"),
    (["proxy", "scripted-upstream", "--port", "0", "--delay", "nan"], "--delay must be a finite number >= 0, got nan"),
    (["proxy", "scripted-upstream", "--port", "0", "--slots", "-1"], "--slots must be >= 0"),
    (["proxy", "export", "--records", "{tmp}/r.jsonl"], "mosaic proxy export: the following arguments are required: --out"),
])
def test_proxy_more_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, fragment):
    # issue 11: `--log-level bogus` crashed later in uvicorn (KeyError); `scripted-upstream --port -1`
    # ended in an OverflowError traceback; argparse errors printed the usage block.
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert _exit_code(argv) == 2
    captured = capsys.readouterr()
    assert fragment.replace("{tmp}", str(tmp_path)) in captured.err, captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "rec").exists()
