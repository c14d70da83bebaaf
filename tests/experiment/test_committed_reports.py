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
