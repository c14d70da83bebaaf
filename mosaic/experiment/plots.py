"""PNG plots of a grid report: learning curves with a band over seeds, accuracy with intervals,
sessions per trajectory, positive-gain share."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from mosaic.experiment.spec import Grid

__all__ = ["make_plots"]


def make_plots(grid: Grid, data: dict, out: Path) -> list[Path]:
    """The report's PNGs; none (the report says so) when matplotlib is not installed (the ``lab`` extra)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print("[mosaic] matplotlib is not installed: the report has no plots (pip install 'mosaic-rl[lab]')",
              file=sys.stderr, flush=True)
        return []
    import matplotlib  # here, not at module level: the Agg backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    groups = {k: g for k, g in data["groups"].items() if g["seeds"]}
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, g in groups.items():
        curves = [dict(s["curve"]) for s in g["seeds"].values()]
        steps = sorted(set().union(*curves))
        m = np.array([[c.get(t, np.nan) for t in steps] for c in curves], dtype=float)
        mean = np.nanmean(m, 0)
        ax.plot(steps, mean, label=f"{key} ({len(curves)} seeds)")
        if len(curves) > 1:
            ax.fill_between(steps, np.nanmin(m, 0), np.nanmax(m, 0), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training reward (critic/score/mean)")
    ax.set_title(f"{grid.name}: learning curves (band: min-max over seeds)")
    ax.legend(fontsize=7)
    paths.append(_save(fig, out / "learning_curves.png"))

    ev = [e.name for e in grid.evals]
    acc = {k: [] for k in groups}
    for k, g in groups.items():
        for e in ev:
            per_seed = [np.mean(list(s["evals"][e][0].values())) for s in g["seeds"].values() if e in s["evals"]]
            acc[k].append((np.mean(per_seed), np.min(per_seed), np.max(per_seed)) if per_seed else (np.nan,) * 3)
    paths.append(_bars(plt, acc, ev, "held-out accuracy (bar: mean over seeds; whisker: min-max)",
                       out / "accuracy.png", warm=data["warm"]))  # fmt: skip

    for metric, title, fname in (("session/per_traj", "sessions per trajectory", "sessions.png"),
                                 ("session/pos_gain_share/all", "positive-gain share", "pos_gain_share.png")):
        vals = {}
        for k, g in groups.items():
            row = []
            for e in ev:
                v = [s["evals"][e][1]["metrics"].get(metric, np.nan) for s in g["seeds"].values() if e in s["evals"]]
                row.append((np.nanmean(v), np.nanmin(v), np.nanmax(v)) if v else (np.nan,) * 3)
            vals[k] = row
        paths.append(_bars(plt, vals, ev, f"{title} on held-out questions", out / fname))
    return paths


def _bars(plt, vals: dict, evals: list[str], title: str, path: Path, warm: dict | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    n = max(1, len(vals))
    width = 0.8 / n
    x = np.arange(len(evals))
    for i, (k, rows) in enumerate(vals.items()):
        mean = np.array([r[0] for r in rows])
        err = np.array([[r[0] - r[1] for r in rows], [r[2] - r[0] for r in rows]])
        ax.bar(x + i * width, mean, width, yerr=err, capsize=3, label=k)
    if warm:
        w = next(iter(warm.values()), {})
        for j, e in enumerate(evals):
            if e in w:
                ax.hlines(np.mean(list(w[e][0].values())), j - 0.1, j + 0.9, colors="k", linestyles="dashed",
                          label="warm start" if j == 0 else None)  # fmt: skip
    ax.set_xticks(x + 0.4 - width / 2, evals)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
