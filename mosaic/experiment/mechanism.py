"""What a grid report follows per training step to make the mechanism visible (issue 28 item 4): sessions
per trajectory for successes and failures apart, the positive-gain share, the answer rate, how the groups
split by outcome, and the held-out accuracy logged during training; and the table of how each moved
between the first and the last steps of each seed."""

from __future__ import annotations

import numpy as np

__all__ = ["MECHANISM", "mechanism_series", "mechanism_table", "md_mechanism"]


MECHANISM = (
    ("session/per_traj/success", "sessions per successful trajectory"),
    ("session/per_traj/failure", "sessions per failed trajectory"),
    ("session/pos_gain_share/all", "positive-gain share"),
    ("session/end/answer", "answer rate"),
    ("groups/mixed_share", "share of mixed groups"),
    ("val-core", "validation accuracy (every train.eval_every steps)"),
)
"""Per-step metrics the mechanism plot follows (``val-core``: whichever held-out accuracy the run logged
during training)."""


def mechanism_series(metrics: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` of :data:`MECHANISM` from a run's metrics lines."""
    out: dict[str, list[tuple[int, float]]] = {}
    for m in metrics:
        if "step" not in m:
            continue
        for key, _ in MECHANISM:
            v = m.get(key) if key != "val-core" else next(
                (x for k, x in m.items() if k.startswith("val-core/") and "/acc/mean@" in k), None)
            if isinstance(v, (int, float)) and np.isfinite(v):
                out.setdefault(key, []).append((int(m["step"]), float(v)))
    return out


def mechanism_table(data: dict, window: int = 10) -> list[dict]:
    """Per arm and :data:`MECHANISM` metric: the mean over seeds of each seed's mean over its first and its
    last ``window`` logged steps, and the seeds' change (last − first) with its min and max; [] when no
    run logged a metric at two steps or more."""
    rows = []
    for k, g in data["groups"].items():
        for key, title in MECHANISM:
            firsts, lasts = [], []
            for s in g["seeds"].values():
                pts = sorted(s.get("series", {}).get(key, []))
                if len(pts) >= 2:
                    w = max(1, min(window, len(pts) // 2))
                    firsts.append(float(np.mean([v for _, v in pts[:w]])))
                    lasts.append(float(np.mean([v for _, v in pts[-w:]])))
            if firsts:
                d = np.array(lasts) - np.array(firsts)
                rows.append({"group": k, "metric": key, "title": title, "seeds": len(firsts),
                             "first": float(np.mean(firsts)), "last": float(np.mean(lasts)),
                             "change": float(d.mean()), "change_min": float(d.min()), "change_max": float(d.max())})
    return rows


def md_mechanism(rows: list[dict]) -> list[str]:
    out = ["### The mechanism over training", "",
           "Each seed's mean over its first and its last 10 logged steps (fewer when a run logged fewer than 20), "
           "averaged over seeds; the change per seed, min to max. Plot: `plots/mechanism.png`.", "",
           "| arm | metric | seeds | first | last | change (min, max over seeds) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['group']} | {r['title']} | {r['seeds']} | {r['first']:.3f} | {r['last']:.3f} | "
                   f"{r['change']:+.3f} ({r['change_min']:+.3f}, {r['change_max']:+.3f}) |")
    return out + [""]
