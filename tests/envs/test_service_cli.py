"""``mosaic data generate`` / ``show`` with ``data.family=service``."""

import json

import pytest

from mosaic.cli import main


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOSAIC_CACHE", str(tmp_path / "cache"))


def test_generate_and_show_a_service_split(capsys):
    assert main(["data", "generate", "data.family=service", "data.n_train_tasks=40", "data.visits=3",
                 "data.events_between=1", "data.unannounced_share=0.4"]) == 0
    out = capsys.readouterr().out
    assert "family=service episodes=40 visits=3 events_between=1 unannounced_share=0.4" in out
    assert "revalidating expert solves 100.0% (stale actions 0)" in out
    assert main(["data", "show", "data.family=service", "--split", "test", "--index", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("id:      test-00003-") and "visit 2: Visit 2 of 2" in out and "required:" in out
    assert main(["data", "show", "data.family=service", "--index", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["split"] == "validation" and data["visits"][0]["required"]


@pytest.mark.parametrize("argv, message", [
    (["data", "show", "data.family=service", "--index", "9999"], "--index must be in"),
    (["data", "search", "data.family=service", "x"], "only generate, show and export"),
    (["data", "search", "x", "data.family=service"], "only generate, show and export"),  # query first, too
    (["data", "search", "data.family=service"], "QUERY: give one search query"),  # not taken for the query
    (["data", "search", "x", "y", "data.family=service"], "QUERY: give one search query"),
    (["data", "generate", "data.family=service", "data.visits=51"], "must be <= 50"),
    (["data", "generate", "data.family=service", "--set", "n_tasks=3"], "--set applies to deep-search"),
    (["data", "generate", "data.family=service", "data.unannounced_share=1.5"], "unannounced_share"),
    (["data", "generate", "data.family=shop"], "data.family"),
    (["data", "generate", "data.family=service", "--recall"], "no searched world"),  # deep search's knobs
    (["data", "generate", "data.family=service", "data.world_entities=50"], "applies to deep search only"),
    (["data", "generate", "data.family=service", "data.hop_mix=[[2,1.0]]"], "applies to deep search only"),
])
def test_bad_service_arguments_are_one_line_and_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_export_and_import_a_service_split_round_trip(tmp_path, capsys):
    from mosaic.envs.export import export_parquet, load_parquet, read_rows
    from mosaic.envs.service.splits import load_service_split, service_config

    out = tmp_path / "svc.parquet"
    assert main(["data", "export", "data.family=service", "data.n_eval_tasks=64", "--split", "validation",
                 "--out", str(out)]) == 0
    assert "wrote 64 validation service episodes" in capsys.readouterr().out
    assert main(["data", "import", str(out), "--head", "1"]) == 0
    text = capsys.readouterr().out
    assert "64 service episodes, splits={'validation': 64}, visits={2: 64}" in text and "traps=" in text
    cfg = service_config("validation", "cpu")
    episodes = load_service_split("validation", cfg)
    assert [e.to_json() for e in load_parquet(out)] == [e.to_json() for e in episodes]  # regenerated, whole
    row = read_rows(out)[5]
    assert row["data_source"] == "mosaic/service" and row["agent_name"] == "mosaic_agent"
    assert row["prompt"][1]["content"] == episodes[5].question and row["reward_model"]["ground_truth"] == episodes[5].answer
    with pytest.raises(ValueError, match="ServiceConfig"):
        export_parquet(episodes[:2], tmp_path / "x.parquet")
    from mosaic.envs.splits import load_split, split_config

    task = load_split("validation", split_config("validation", "cpu"), tmp_path / "c").tasks[0]
    with pytest.raises(ValueError, match="one family per file"):
        export_parquet([episodes[0], task], tmp_path / "x.parquet", split_config=cfg)


def test_a_service_row_from_another_generator_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mosaic.envs.export import export_parquet, load_parquet, read_rows
    from mosaic.envs.service.export import service_config_from_json
    from mosaic.envs.service.splits import load_service_split, service_config

    cfg = service_config("test", "cpu")
    rows = read_rows(export_parquet(load_service_split("test", cfg)[:2], tmp_path / "a.parquet", split_config=cfg))
    rows[1]["extra_info"]["question"] = "Visit 1 of 2, day 1. Someone else says: hello"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="another first visit or answer"):
        load_parquet(tmp_path / "b.parquet")
    for bad, msg in (("", "is empty"), ("{", "not JSON"), ('{"bogus": 1}', "not a ServiceConfig"),
                     ('{"n_users": 0}', "n_users"), ('{"n_users": 20000000}', "n_users"), ('{"seed": "x"}', "seed"),
                     ('{"seed": 1.5}', "seed"), ('{"n_users": true}', "n_users"), ('{"unannounced_share": "0.5"}', "share"),
                     ('{"unannounced_share": null}', "share"), ('{"name_partition": 5}', "name_partition"),
                     ('{"name_partition": ["a", "b"]}', "name_partition"), ("[1]", "not a ServiceConfig")):
        with pytest.raises(ValueError, match=msg):
            service_config_from_json(bad)


def test_an_empty_parquet_file_is_not_an_export(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"x": pa.array([], type=pa.int64())}), path)
    assert main(["data", "import", str(path)]) == 2
    assert "holds no rows" in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_the_output_quietly():
    """``mosaic data show ... | head``: the closed pipe ends the command with status 141 and no traceback."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "mosaic.cli", "data", "show", "data.family=service", "--index", "0",
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before a byte is read
    err = p.stderr.read().decode()
    assert p.wait() == 141 and "Traceback" not in err, err
