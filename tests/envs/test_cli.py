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
