"""The grid report's learning-curve plot stays readable with many arms (issue 33, item 10): one panel
per arm, its band over seeds in colour, the other arms faint behind it, not seven arms in one panel."""

from __future__ import annotations

import os
import shutil

import numpy as np

from mosaic.experiment.plots import make_plots
from mosaic.experiment.spec import EvalSpec, Grid

ARMS = ["grpo", "broadcast", "mosaic", "mosaic-traj", "mosaic-session", "turn-level", "fold"]


def _data(seeds=3, steps=20):
    rng = np.random.default_rng(0)
    groups = {}
    for i, arm in enumerate(ARMS):
        per = {}
        for s in range(seeds):
            ys = 0.2 + 0.02 * i + 0.3 * (1 - np.exp(-np.arange(steps) / 8)) + rng.normal(0, 0.03, steps)
            per[s] = {"curve": [[t + 1, float(y)] for t, y in enumerate(ys)], "evals": {}}
        groups[f"{arm}/base"] = {"seeds": per}
    return {"groups": groups, "warm": {}, "warm_answers": {}}


def test_seven_arms_get_one_panel_each(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = Grid(name="seven", preset="cpu", common=(), arms={a: () for a in ARMS}, settings={"base": ()},
                seeds=(0, 1, 2), evals=(EvalSpec(name="test", split="test"),))
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))  # keep the figures to inspect
    paths = make_plots(grid, _data(), tmp_path)
    png = tmp_path / "learning_curves.png"
    assert png in paths and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = figs[0]
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == len(ARMS)
    assert [ax.get_title() for ax in panels] == [f"{a}/base (3 seeds)" for a in ARMS]
    for ax in panels:
        coloured = [ln for ln in ax.get_lines() if ln.get_color() != "0.8"]
        faint = [ln for ln in ax.get_lines() if ln.get_color() == "0.8"]
        assert len(coloured) == 1 and len(faint) == len(ARMS) - 1  # its own mean; the others faint
        assert len(ax.collections) == 1  # its band over seeds
    if os.environ.get("MOSAIC_PLOTS_KEEP"):
        shutil.copy(png, os.environ["MOSAIC_PLOTS_KEEP"])
