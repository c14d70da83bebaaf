import json

import pytest

from mosaic.cli import main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOSAIC_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_data_commands(cache, capsys):
    assert main(["data", "generate", "--preset", "cpu", "--split", "train", "--recall"]) == 0
    out = capsys.readouterr().out
    assert "tasks=200" in out and "retrieval: gold document in top-3" in out

    assert main(["data", "show", "--preset", "cpu", "--split", "validation", "--index", "3"]) == 0
    out = capsys.readouterr().out
    assert "question:" in out and "answer:" in out and "hop 1: search" in out

    assert main(["data", "show", "--preset", "cpu", "--index", "9999"]) == 2
    capsys.readouterr()

    assert main(["data", "search", "--preset", "cpu", "river source", "-k", "2"]) == 0
    assert capsys.readouterr().out.startswith("[1] ")

    assert main(["data", "score", "<answer>The Port-Osk</answer>", "port osk"]) == 0
    assert json.loads(capsys.readouterr().out) == {"reward": 1.0, "answer": "The Port-Osk",
                                                   "status": "ok"}

    out_file = cache / "t.parquet"
    assert main(["data", "export", "--preset", "cpu", "--split", "test", "--out", str(out_file),
                 "--set", "n_tasks=12", "--set", "hop_mix=2:1"]) == 0
    assert "wrote 12 test tasks" in capsys.readouterr().out
    assert main(["data", "import", str(out_file)]) == 0
    assert "12 tasks" in capsys.readouterr().out

    assert main(["data", "calibrate", "--preset", "cpu", "--budget", "512", "768"]) == 0
    out = capsys.readouterr().out
    assert out.count("| hops |") == 2


@pytest.mark.parametrize("argv, fragment", [
    (["data", "search", "--preset", "cpu", "river", "-k", "0"], "mosaic data search: -k must be >= 1, got 0"),
    (["data", "search", "--preset", "cpu", "river", "--snippet-tokens", "-3"], "--snippet-tokens must be >= 1"),
    (["data", "calibrate", "--preset", "cpu", "-k", "0"], "mosaic data calibrate: -k must be >= 1"),
    (["data", "calibrate", "--preset", "cpu", "--searches-per-hop", "0"], "--searches-per-hop must be >= 1"),
    (["data", "calibrate", "--preset", "cpu", "--budget", "512", "0"], "--budget must be >= 1, got 0"),
    (["data", "calibrate", "--preset", "cpu", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["data", "import", "{tmp}/missing.parquet"], "mosaic data import: PATH {tmp}/missing.parquet: no such file"),
    (["data", "import", "{tmp}/junk.parquet"], "not a task Parquet file written by `mosaic data export`"),
    (["data", "import", "{tmp}"], "PATH {tmp}: is a directory"),
    (["data", "import", "{tmp}/junk.parquet", "--head", "-1"], "--head must be >= 0"),
    (["data", "export", "--preset", "cpu", "--out", "{tmp}/junk.parquet/x.parquet"], "--out {tmp}/junk.parquet/x.parquet"),
    (["data", "show", "--preset", "cpu", "--set", "n_tasks=-5"], "--set n_tasks=-5: n_tasks must be >= 1"),
    (["data", "show", "--preset", "cpu", "--set", "n_tasks=abc"], "--set n_tasks=abc: bad key or value"),
    (["data", "show", "--preset", "cpu", "--set", "nope=1"], "--set nope=1: bad key or value"),
    (["data", "show", "--preset", "cpu", "--set", "noequals"], "--set expects KEY=VALUE"),
    (["data", "show", "--preset", "cpu", "--set", "world.bogus=3"], "--set world.bogus=3: unknown world field"),
    (["data", "search", "--preset", "cpu", "river", "--set", "world.n_entities=abc"],
     "--set world.n_entities=abc: world.n_entities must be an integer, got 'abc'"),
    (["data", "show", "--preset", "cpu", "--set", "world.n_entities=1.5"], "world.n_entities must be an integer"),
    (["data", "show", "--preset", "cpu", "--set", "world.distractor_density=x"],
     "--set world.distractor_density=x: world.distractor_density must be a number, got 'x'"),
    (["data", "show", "--preset", "cpu", "--set", "world.n_entities=-4"], "--set world.n_entities=-4: n_entities"),
    (["data", "show", "--preset", "cpu", "--set", "hop_mix=bad"], "--set hop_mix=bad: expected HOPS:WEIGHT"),
    (["data", "show", "--preset", "cpu", "--set", "hop_mix=9:1"], "--set hop_mix=9:1: hop_mix keys must be"),
    (["data", "show", "--preset", "cpu", "--set", "snippet_mode=zzz"], "--set snippet_mode=zzz: snippet_mode must"),
    (["data", "show", "--preset", "cpu", "--cache-dir", "{tmp}/junk.parquet"], "--cache-dir {tmp}/junk.parquet: not a"),
    (["data", "show", "--preset", "cpu", "--index", "-1"], "mosaic data show: --index must be in [0, "),
    # an output that cannot be created (a pseudo file system takes no new entries)
    (["data", "generate", "--preset", "cpu", "--cache-dir", "/proc/nope"], "--cache-dir /proc/nope: cannot create"),
    (["data", "export", "--preset", "cpu", "--out", "/proc/x.parquet"], "--out /proc/x.parquet: cannot write a file"),
    (["data", "score", "--metric", "em", "", ""], "mosaic data score: GROUND_TRUTH '': must be a non-empty answer"),
    (["data", "score", "<answer>x</answer>", "  "], "GROUND_TRUTH '  ': must be a non-empty answer"),
])
def test_bad_arguments_exit_2_with_one_line_naming_the_flag(cache, capsys, argv, fragment):
    # issue 11: `data search -k 0` and friends ended in tracebacks.
    (cache / "junk.parquet").write_text("hello")
    argv = [a.replace("{tmp}", str(cache)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment.replace("{tmp}", str(cache)) in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
