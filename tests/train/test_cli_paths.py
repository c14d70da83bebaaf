"""Paths a config names that cannot be used (issue 33 item 5): one line, exit 2, before any work.

"Before any work" is checked by making the first heavy steps (building or loading a model, loading a
split) fail the test if they are reached."""

from __future__ import annotations

import json

import pytest

from mosaic.cli import main


@pytest.fixture()
def no_work(monkeypatch):
    from mosaic.train import setup

    def reached(*a, **k):
        raise AssertionError("work started before the bad path was reported")

    for name in ("build_base_model", "load_policy", "load_split"):
        monkeypatch.setattr(setup, name, reached)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def _cases(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    bad_traj = tmp_path / "bad.jsonl"
    bad_traj.write_text(json.dumps({"a": 1}) + "\n")
    records = tmp_path / "records"
    records.mkdir()
    (records / "records.jsonl").write_text("not json\n{}\n")
    ok_out = tmp_path / "sft-out"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    m_json, m_trunc = tmp_path / "m_json", tmp_path / "m_trunc"
    for m in (m_json, m_trunc):
        m.mkdir()
    (m_json / "config.json").write_text("{not json")
    (m_trunc / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (m_trunc / "model.safetensors").write_bytes(b"")
    m_hdr = tmp_path / "m_hdr"  # a header that parses as JSON but names a dtype no loader knows
    m_hdr.mkdir()
    (m_hdr / "config.json").write_text(json.dumps({"model_type": "llama"}))
    head = json.dumps({"w": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (m_hdr / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + b"\0" * 4)
    return [
        (["train", "train.run_dir=/proc/forbidden"], "config key 'train.run_dir': /proc/forbidden: cannot create"),
        (["train", f"train.run_dir={afile}"], f"config key 'train.run_dir': {afile}: not a directory"),
        (["sft", "sft.data=/nonexistent.jsonl", f"sft.output_dir={ok_out}"],
         "config key 'sft.data': /nonexistent.jsonl: no such file"),
        (["sft", "sft.output_dir=/proc/x"], "config key 'sft.output_dir': /proc/x: cannot create"),
        (["sft", f"sft.data={tmp_path}", f"sft.output_dir={ok_out}"], "is a directory, not a file"),
        (["sft", f"sft.data={bad_traj}", f"sft.output_dir={ok_out}"],
         f"config key 'sft.data': {bad_traj}:1: not a Mosaic trajectory record"),
        (["train", "rollout.source=records", "rollout.records=/nonexistent", f"train.run_dir={tmp_path / 'r1'}"],
         "config key 'rollout.records': /nonexistent: no such file or directory"),
        (["train", "rollout.source=records", f"rollout.records={records}", f"train.run_dir={tmp_path / 'r2'}"],
         "rollout.records: "),
        (["train", "model.source=dir", "model.path=/nonexistent", f"train.run_dir={tmp_path / 'r3'}"],
         "config key 'model.path': /nonexistent: no such directory"),
        (["train", "model.source=dir", f"model.path={tmp_path}", f"train.run_dir={tmp_path / 'r4'}"],
         "no config.json"),
        (["eval", "model.source=dir", "model.path=/nonexistent", f"train.run_dir={tmp_path / 'r5'}"],
         "config key 'model.path': /nonexistent: no such directory"),
        (["train", f"data.cache_dir={afile}", f"train.run_dir={tmp_path / 'r1'}"],
         f"config key 'data.cache_dir': {afile}: not a directory"),
        (["sft", "data.cache_dir=/proc/x", f"sft.output_dir={ok_out}"], "config key 'data.cache_dir': /proc/x: cannot create"),
        (["eval", "data.cache_dir=/proc/x", f"train.run_dir={tmp_path / 'r5'}"], "config key 'data.cache_dir': /proc/x"),
        (["train", "model.source=dir", f"model.path={m_json}", f"train.run_dir={tmp_path / 'r3'}"],
         f"config key 'model.path': {m_json}: config.json does not parse"),
        (["eval", "model.source=dir", f"model.path={m_trunc}", f"train.run_dir={tmp_path / 'r5'}"],
         f"config key 'model.path': {m_trunc}: model.safetensors: truncated (0 bytes"),
        (["eval", "--checkpoint", str(m_trunc), f"train.run_dir={tmp_path / 'r5'}"], f"--checkpoint {m_trunc}: model.safetensors"),
        (["sft", f"sft.data={empty}", f"sft.output_dir={ok_out}"], f"config key 'sft.data': {empty} holds no trajectories"),
        (["train", "algo.count_kinds=[wizard]", f"train.run_dir={tmp_path / 'r1'}"],
         "config key 'algo.count_kinds': unknown session kind(s) ['wizard']"),
        (["train", "model.source=dir", f"model.path={m_hdr}", f"train.run_dir={tmp_path / 'r3'}"],
         "model.safetensors: corrupt safetensors header (Error while deserializing header"),
        # what the service family cannot run is refused, never silently run as deep search
        (["train", "data.family=service", "harness.mode=reset", "harness.reset_roles=[a,b]", "harness.partner=expert",
          f"train.run_dir={tmp_path / 'r1'}"], "config key 'harness.partner': expert"),
        # (service records replay: bad records are the replay's one line, as for deep search)
        (["train", "data.family=service", "rollout.source=records", f"rollout.records={records}",
          f"train.run_dir={tmp_path / 'r2'}"], "rollout.records: "),
    ]


@pytest.mark.parametrize("case", range(22))
def test_bad_paths_are_one_line_exit_2_before_any_work(tmp_path, capsys, no_work, case):
    argv, fragment = _cases(tmp_path)[case]
    assert main(argv) == 2, argv
    err = _one_line(capsys)
    assert err.startswith(f"mosaic {argv[0]}: ") and fragment in err, (argv, err)
    for name in ("r1", "r2", "r3", "r4", "r5", "sft-out"):
        assert not (tmp_path / name).exists()  # nothing was created


def test_view_of_a_bad_trajectory_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "rollouts.jsonl"
    f.write_text(json.dumps({"schema": "mosaic.trajectory", "id": "t"}) + "\n")
    assert main(["view", str(f)]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"mosaic view: {f}:1: ")
    assert not f.with_suffix(".html").exists()


@pytest.mark.parametrize("content, fragment", [
    (b"\xff\xfe\x00garbage", "is not UTF-8 text (byte 0)"),
    (b'{"a": 1}\n{"b": 2}\n', "is not valid YAML: expected '<document start>', but found '{' (line 2, column 1)"),
    (b"a: [1\n", "is not valid YAML: "),
    (b"- 1\n- 2\n", "the grid file must hold a mapping"),
])
def test_experiment_garbage_grid_is_one_line(tmp_path, capsys, content, fragment):
    g = tmp_path / "garbage.jsonl"
    g.write_bytes(content)
    assert main(["experiment", str(g), "--dry-run"]) == 2
    err = _one_line(capsys)
    assert err.startswith("mosaic experiment: ") and fragment in err


def test_data_and_serve_refuse_an_unusable_cache_or_model_in_one_line(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["data", "generate", f"data.cache_dir={afile}"]) == 2
    assert _one_line(capsys) == f"mosaic data generate: config key 'data.cache_dir': {afile}: not a directory"
    monkeypatch.setenv("MOSAIC_CACHE", "/proc/x")
    assert main(["data", "generate"]) == 2
    assert _one_line(capsys).startswith("mosaic data generate: $MOSAIC_CACHE /proc/x: cannot create the directory")
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (m / "model.safetensors").write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")
    assert main(["serve", "--model", str(m), "--port", "0"]) == 2
    assert _one_line(capsys) == f"mosaic serve: {m}: model.safetensors: corrupt safetensors header (length {10 ** 12} " \
                                "in a file of 10 bytes)"


def test_a_tokenizer_dir_without_tokenizer_json_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    records = tmp_path / "rec"
    records.mkdir()
    (records / "records.jsonl").write_text("")
    for argv in (["proxy", "export", "--records", str(records), "--out", str(tmp_path / "x.jsonl"), "--tokenizer", str(tmp_path)],
                 ["rollout", "--split", "validation", "--n-tasks", "1", "--out", str(tmp_path / "r.jsonl"),
                  "--tokenizer", str(tmp_path), f"data.cache_dir={tmp_path / 'cache'}"]):
        assert main(argv) == 2, argv
        assert f"--tokenizer {tmp_path}: no tokenizer.json in this directory" in _one_line(capsys)


def test_compare_bounds_its_resamples_and_names_a_stray_comma(tmp_path, capsys):
    a = tmp_path / "a.jsonl"
    a.write_text(json.dumps({"question_id": "q", "correct": 1}) + "\n")
    assert main(["compare", str(a), str(a), "--n-boot", "100000000000"]) == 2
    assert "--n-boot must be in [1, 10000000]" in _one_line(capsys)
    assert main(["compare", f"{a},", f"{a},{a}"]) == 2
    assert "an empty name in" in _one_line(capsys)


def test_view_of_a_run_whose_metrics_hold_a_non_object_line_names_it(tmp_path, capsys):
    from mosaic.train.runlog import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "x": 1}\n[1, 2]\ngarbage{\n')
    assert read_metrics(tmp_path) == [{"step": 1, "x": 1}]
    err = capsys.readouterr().err
    assert "metrics.jsonl: 2 line(s) that are not JSON objects skipped (the first: line 2)" in err
