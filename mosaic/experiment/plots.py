"""PNG plots of a grid report: learning curves with a band over seeds, accuracy with intervals,
sessions per trajectory, positive-gain share.

The learning curves are small multiples: one panel per arm (sharing both axes), the arm in colour
with its min-max band over seeds, every other arm's mean as a faint grey line behind it for
comparison, so seven arms stay readable (issue 33)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from mosaic.experiment.spec import Grid

__all__ = ["learning_curves_figure", "make_plots", "mechanism_figure"]


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

    fig = learning_curves_figure(plt, grid.name, groups)
    paths.append(_save(fig, out / "learning_curves.png"))

    ev = [e.name for e in grid.evals]
    acc = {k: [] for k in groups}
    for k, g in groups.items():
        for e in ev:
            per_seed = [np.mean(list(s["evals"][e][0].values())) for s in g["seeds"].values() if e in s["evals"]]
            acc[k].append((np.mean(per_seed), np.min(per_seed), np.max(per_seed)) if per_seed else (np.nan,) * 3)
    paths.append(_bars(plt, acc, ev, "held-out accuracy (bar: mean over seeds; whisker: min-max)",
                       out / "accuracy.png", warm=data["warm"]))  # fmt: skip

    fig = mechanism_figure(plt, grid.name, groups)
    if fig is not None:
        paths.append(_save(fig, out / "mechanism.png"))

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


def _mean_curve(g: dict) -> tuple[list, np.ndarray, np.ndarray]:
    """(steps, the seeds' values (seeds, steps) with NaN where a seed has no point, their mean)."""
    curves = [dict(s["curve"]) for s in g["seeds"].values()]
    steps = sorted(set().union(*curves))
    m = np.array([[c.get(t, np.nan) for t in steps] for c in curves], dtype=float).reshape(len(curves), len(steps))
    return steps, m, (np.nanmean(m, 0) if steps else np.zeros(0))


def learning_curves_figure(plt, name: str, groups: dict):
    """One panel per arm (``groups``: key -> {"seeds": {seed: {"curve": [[step, reward], ...]}}})."""
    keys = list(groups)
    n = max(1, len(keys))
    cols = min(n, 3 if n > 4 else 2 if n > 1 else 1)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.5 * rows + 0.5), sharex=True, sharey=True,
                             squeeze=False)  # fmt: skip
    curves = {k: _mean_curve(groups[k]) for k in keys}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ax in enumerate(axes.flat):
        if i >= len(keys):
            ax.set_visible(False)
            continue
        key = keys[i]
        for other in keys:  # the rest, faint, for comparison
            if other != key and curves[other][0]:
                ax.plot(curves[other][0], curves[other][2], color="0.8", linewidth=0.8, zorder=1)
        steps, m, mean = curves[key]
        c = colours[i % len(colours)]
        ax.plot(steps, mean, color=c, linewidth=1.8, zorder=3, label="mean")
        if len(m) > 1:
            ax.fill_between(steps, np.nanmin(m, 0), np.nanmax(m, 0), color=c, alpha=0.25, zorder=2, label="min-max")
        ax.set_title(f"{key} ({len(m)} seed{'s' if len(m) != 1 else ''})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    from matplotlib.ticker import MaxNLocator

    for j in range(cols):  # the lowest visible panel of each column carries the step axis
        low = [ax for ax in axes[:, j] if ax.get_visible()]
        if low:
            low[-1].xaxis.set_tick_params(labelbottom=True)
            low[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
            low[-1].set_xlabel("step", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("training reward", fontsize=8)
    fig.suptitle(f"{name}: training reward (critic/score/mean) per arm; band: min-max over seeds; "
                 f"grey: the other arms' means", fontsize=9)
    return fig


def mechanism_figure(plt, name: str, groups: dict):
    """Per training step, one panel per :data:`~mosaic.experiment.report.MECHANISM` metric the runs logged
    at two steps or more: each arm's mean over seeds, with a min-max band; None when no metric has."""
    from mosaic.experiment.mechanism import MECHANISM

    panels = []
    for key, title in MECHANISM:
        arms = {}
        for k, g in groups.items():
            series = [dict(s.get("series", {}).get(key, [])) for s in g["seeds"].values()]
            series = [c for c in series if c]
            if series:
                steps = sorted(set().union(*series))
                arms[k] = (steps, np.array([[c.get(t, np.nan) for t in steps] for c in series], dtype=float))
        if any(len(st) >= 2 for st, _ in arms.values()):
            panels.append((title, arms))
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 2.7 * rows + 0.6), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, arms) in zip(axes.flat, panels):
        for k, (steps, m) in arms.items():  # an arm keeps its colour in every panel (some log a metric, some not)
            c = colours[list(groups).index(k) % len(colours)]
            ax.plot(steps, np.nanmean(m, 0), color=c, linewidth=1.6, label=f"{k} ({len(m)})")
            if len(m) > 1:
                ax.fill_between(steps, np.nanmin(m, 0), np.nanmax(m, 0), color=c, alpha=0.2)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{name}: the mechanism per training step; line: mean over seeds (count in brackets), "
                 f"band: min-max", fontsize=9)
    return fig


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
