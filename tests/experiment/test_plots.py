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
    from mosaic.train.metrics import as_val_aux

    def run(drop: float) -> list[dict]:
        rows = []
        for step in range(1, 31):
            m = {"step": step, "session/per_traj/success": 5.0 - drop * step / 30, "session/per_traj/failure": 5.0,
                 "session/pos_gain_share/all": 0.45 + 0.001 * step, "session/end/answer": 0.9, "groups/mixed_share": 0.4}
            if step % 10 == 0:  # the periodic validation, under its own names (as_val_aux)
                m.update(as_val_aux({"val-core/deepsearch-validation/acc/mean@1": 0.3 + 0.01 * step / 10,
                                     "session/per_traj/success": 9.0, "session/pos_gain_share/all": 0.6}))
            rows.append(m)
        return rows

    data = {"groups": {f"{arm}/base": {"seeds": {s: {"series": mechanism_series(run(drop))} for s in range(3)}}
                       for arm, drop in (("broadcast", 0.0), ("mosaic", 1.5))}}
    series = data["groups"]["mosaic/base"]["seeds"][0]["series"]
    assert [v for _, v in series["val-core"]] == pytest.approx([0.31, 0.32, 0.33])
    assert series["val-aux/session/pos_gain_share/all"] == [(10, 0.6), (20, 0.6), (30, 0.6)]
    assert len(series["session/per_traj/success"]) == 30 and max(v for _, v in series["session/per_traj/success"]) < 9
    rows = {(r["group"], r["metric"]): r for r in mechanism_table(data)}
    assert abs(rows[("mosaic/base", "session/per_traj/success")]["change"] + 1.0) < 1e-9  # 20 steps of the 1.5 drop
    assert rows[("broadcast/base", "session/per_traj/success")]["change"] == 0.0
    assert rows[("mosaic/base", "val-core")]["first"] == pytest.approx(0.31) and rows[("mosaic/base", "val-core")]["seeds"] == 3
    fig = mechanism_figure(plt, "g", data["groups"])
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 8  # all-fail share and val sessions of failures: not logged
    plt.close(fig)
    assert mechanism_figure(plt, "g", {"a/base": {"seeds": {0: {"series": {}}}}}) is None


def test_runs_before_val_aux_keep_the_validation_apart_from_the_training_rollouts():
    """Runs that logged the periodic validation's rollout metrics bare, over the training step's: on such a
    line the bare names are the validation's (the training value of that step is lost, not mixed in)."""
    from mosaic.experiment.mechanism import mechanism_series

    rows = [{"step": 1, "session/pos_gain_share/all": 0.4},
            {"step": 2, "session/pos_gain_share/all": 0.7, "val-core/deepsearch/acc/mean@1": 0.3,
             "val-aux/deepsearch/acc/ci_lo@1": 0.2},
            {"step": 3, "session/pos_gain_share/all": 0.5}]
    s = mechanism_series(rows)
    assert s["session/pos_gain_share/all"] == [(1, 0.4), (3, 0.5)]
    assert s["val-aux/session/pos_gain_share/all"] == [(2, 0.7)] and s["val-core"] == [(2, 0.3)]


def test_the_arms_mechanism_is_contrasted_over_seeds_per_phase():
    """Issue 28 item 4, "does Mosaic change how many sessions the policy spends, relative to broadcast, and
    when?": per phase of training, A − B over seeds with the exact permutation p; a planted separation in
    the second half is found there and not in the first; a metric only one arm logged has no row."""
    from mosaic.experiment.mechanism import md_contrast, mechanism_contrast

    def seeds(late: float, n: int = 5) -> dict:
        return {s: {"series": {"session/per_traj/success": [(t, 4.0 + 0.01 * s + (late if t > 20 else 0.0))
                                                            for t in range(1, 41)]}} for s in range(n)}

    data = {"groups": {"broadcast/base": {"seeds": seeds(0.0)}, "mosaic/base": {"seeds": seeds(-1.0)}}}
    data["groups"]["mosaic/base"]["seeds"][0]["series"]["session/pos_gain_share/all"] = [(1, 0.5), (2, 0.6)]
    rows = mechanism_contrast(data, phases=2, window=10)
    assert [r["metric"] for r in rows] == ["session/per_traj/success"]
    r = rows[0]
    assert r["spans"] == [(1, 20), (21, 40)]
    assert r["phases"][0]["diff"] == pytest.approx(0.0) and r["phases"][0]["p"] == pytest.approx(1.0)
    assert r["phases"][1]["diff"] == pytest.approx(1.0) and r["phases"][1]["p"] == pytest.approx(2 / 252)
    assert r["change"]["diff"] == pytest.approx(1.0) and r["change"]["p_holm"] == pytest.approx(2 / 252)
    md = "\n".join(md_contrast(rows))
    assert "| 1–20, 21–40 |" in md and "phase 2" in md and "broadcast/base − mosaic/base" in md
    assert mechanism_contrast({"groups": {"a/x": {"seeds": seeds(0.0)}, "b/y": {"seeds": seeds(1.0)}}}) == []
    single = {s: {"series": {"session/per_traj/success": [(t, 1.0) for t in range(1, 41)]}} for s in range(5)}
    data["groups"]["grpo/base"] = {"seeds": single}  # a single-session floor: nothing to allocate, no contrast
    assert [(r["a"], r["b"]) for r in mechanism_contrast(data, phases=2)] == [("broadcast/base", "mosaic/base")]
