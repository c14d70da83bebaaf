"""The grid report's learning-curve plot stays readable with many arms (issue 33, item 10): one panel
per arm, its band over seeds in colour, the other arms faint behind it, not seven arms in one panel."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

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


def test_the_mechanism_is_followed_per_step_with_a_seed_band(tmp_path):
    """Issue 28 item 4: sessions for successes and failures, the positive-gain share, the answer rate, the
    mixed-group share and the periodic validation accuracy, per step, per arm, over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mosaic.experiment.plots import mechanism_figure
    from mosaic.experiment.mechanism import mechanism_series, mechanism_table

    def run(drop: float) -> list[dict]:
        rows = []
        for step in range(1, 31):
            m = {"step": step, "session/per_traj/success": 5.0 - drop * step / 30, "session/per_traj/failure": 5.0,
                 "session/pos_gain_share/all": 0.45 + 0.001 * step, "session/end/answer": 0.9, "groups/mixed_share": 0.4}
            if step % 10 == 0:
                m["val-core/deepsearch-validation/acc/mean@1"] = 0.3 + 0.01 * step / 10
            rows.append(m)
        return rows

    data = {"groups": {f"{arm}/base": {"seeds": {s: {"series": mechanism_series(run(drop))} for s in range(3)}}
                       for arm, drop in (("broadcast", 0.0), ("mosaic", 1.5))}}
    assert [v for _, v in data["groups"]["mosaic/base"]["seeds"][0]["series"]["val-core"]] == pytest.approx([0.31, 0.32, 0.33])
    rows = {(r["group"], r["metric"]): r for r in mechanism_table(data)}
    assert abs(rows[("mosaic/base", "session/per_traj/success")]["change"] + 1.0) < 1e-9  # 20 steps of the 1.5 drop
    assert rows[("broadcast/base", "session/per_traj/success")]["change"] == 0.0
    assert rows[("mosaic/base", "val-core")]["first"] == pytest.approx(0.31) and rows[("mosaic/base", "val-core")]["seeds"] == 3
    fig = mechanism_figure(plt, "g", data["groups"])
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 6
    plt.close(fig)
    assert mechanism_figure(plt, "g", {"a/base": {"seeds": {0: {"series": {}}}}}) is None
