"""The committed grids still resolve to their committed runs.

A change of the preset a grid builds on changes its runs' config keys: the finished runs in
``reports/<grid>/work`` then no longer count as done, and ``mosaic experiment report`` silently reports
0 runs (this happened when the cpu preset moved to the validated setting). Each grid pins what it was
trained with; this test keeps the pins and the work dirs' copies of the grid in step."""

from __future__ import annotations

from pathlib import Path

import pytest

from mosaic.experiment.runner import plan
from mosaic.experiment.spec import load_grid

ROOT = Path(__file__).resolve().parents[2]
WORKS = sorted(p.parent for p in (ROOT / "reports").glob("*/work/grid.yaml")
               if (ROOT / "experiments" / f"{p.parent.parent.name}.yaml").is_file())


@pytest.mark.parametrize("work", WORKS, ids=[w.parent.name for w in WORKS])
def test_every_committed_run_of_a_grid_is_still_done(work):
    name = work.parent.name
    assert (work / "grid.yaml").read_text() == (ROOT / "experiments" / f"{name}.yaml").read_text(), \
        f"reports/{name}/work/grid.yaml differs from experiments/{name}.yaml"
    runs_on_disk = {p.parent.name for p in (work / "runs").glob("*/done.json")} if (work / "runs").is_dir() else set()
    units = [u for u in plan(load_grid(work / "grid.yaml"), work) if u.run is not None]
    done = [u for u in units if not u.train and not u.evals]
    if runs_on_disk:  # (a grid still running, like compaction-seeds, has units not yet on disk)
        assert done, f"none of the {len(runs_on_disk)} finished runs counts as done any more"
        lost = sorted(u.name for u in units if u.dir.name in runs_on_disk and u not in done)
        assert not lost, f"finished runs the grid no longer counts as done: {lost[:5]}"


def test_a_damaged_work_dir_is_reported_not_a_traceback(tmp_path):
    """A run killed mid-write or an edited file: the report leaves the damaged piece out and names it; the
    runner redoes an evaluation whose per-question records are gone."""
    import shutil

    from mosaic.experiment.report import write_report
    from mosaic.experiment.runner import _eval_done

    work = tmp_path / "work"
    shutil.copytree(ROOT / "reports" / "forks-seeds" / "work", work)
    runs = sorted((work / "runs").glob("*-base-s*"))
    a, b, c, d, f = (next(r for r in runs if f"{arm}-base-s{s}-" in r.name) for arm, s in
                     (("mosaic", 3), ("mosaic", 4), ("broadcast", 3), ("broadcast", 4), ("mosaic", 5)))
    (a / "evals" / "test.jsonl").write_text((a / "evals" / "test.jsonl").read_text()[:300])  # cut by a kill
    (b / "evals" / "test.json").write_text("garbage")
    (c / "done.json").write_text("{")
    with open(d / "metrics.jsonl", "a") as fh:  # a bad extra line: skipped, every step still there
        fh.write('{"step": "x", "critic/score/mean": "y", "actor/entropy": "z"}\n')
    text = (f / "metrics.jsonl").read_text()
    (f / "metrics.jsonl").write_text(text[: len(text) // 2])  # cut: steps missing, evaluations intact
    write_report(work, tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**4 damaged file(s) left out**" in md
    for p in (a / "evals" / "test.jsonl", b / "evals" / "test.json", c / "done.json", f / "metrics.jsonl"):
        assert f"`{p.relative_to(work)}`" in md
    assert f"`{(d / 'metrics.jsonl').relative_to(work)}`" not in md
    import json

    res = json.loads((tmp_path / "out" / "results.json").read_text())
    mosaic = res["tables"][0]["arms"]["mosaic/base"]
    assert mosaic["seeds"] == 8  # s3 and s4 lost an evaluation; s5 keeps its evaluations without its series
    grid = load_grid(work / "grid.yaml")
    e = next(x for x in grid.evals if x.name == "test")
    assert _eval_done(d, e)
    (d / "evals" / "test.jsonl").unlink()
    assert not _eval_done(d, e)
