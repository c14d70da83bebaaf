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
    (["data", "search", "data.family=service", "x"], "only generate and show"),
    (["data", "generate", "data.family=service", "--set", "n_tasks=3"], "--set applies to deep-search"),
    (["data", "generate", "data.family=service", "data.unannounced_share=1.5"], "unannounced_share"),
    (["data", "generate", "data.family=shop"], "data.family"),
])
def test_bad_service_arguments_are_one_line_and_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
