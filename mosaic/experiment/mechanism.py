"""What a grid report follows per training step to make the mechanism visible (issue 28 item 4): sessions
per trajectory for successes and failures apart, the positive-gain share, the answer rate, how the groups
split by outcome, and the held-out accuracy logged during training; the table of how each moved between
the first and the last steps of each seed; and the contrast of two arms per phase of training, tested over
seeds (the unit of "A trains differently from B")."""

from __future__ import annotations

import numpy as np

from mosaic.train.stats import holm, seed_permutation_test

__all__ = ["MECHANISM", "finite_number", "mechanism_contrast", "mechanism_series", "mechanism_table", "md_contrast", "md_mechanism"]


MECHANISM = (
    ("session/per_traj/success", "sessions per successful trajectory (training)"),
    ("session/per_traj/failure", "sessions per failed trajectory (training)"),
    ("session/pos_gain_share/all", "positive-gain share (training, where scored)"),
    ("session/end/answer", "answer rate (training)"),
    ("groups/mixed_share", "share of mixed groups (training)"),
    ("groups/all_fail_share", "share of all-fail groups (training)"),
    ("val-aux/session/per_traj/success", "sessions per successful trajectory (validation)"),
    ("val-aux/session/per_traj/failure", "sessions per failed trajectory (validation)"),
    ("val-aux/session/pos_gain_share/all", "positive-gain share (validation)"),
    ("val-core", "validation accuracy"),
)
"""Per-step metrics the mechanism plot follows: the training rollouts' own, and the periodic validation's
(``train.eval_every``: every arm's policy on the same questions, gains scored whatever the estimator;
``val-core``: whichever held-out accuracy the run logged)."""


def finite_number(v) -> bool:
    """A real, finite number (not a bool, not NaN or inf): what a metrics line's step or value must be."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and bool(np.isfinite(v))


def _legacy(m: dict) -> bool:
    """Runs before ``as_val_aux`` logged the periodic validation's rollout metrics bare, over the training
    step's: such a line has a ``val-core/`` name and no ``val-aux/session/`` one."""
    return any(k.startswith("val-core/") for k in m) and not any(k.startswith("val-aux/session/") for k in m)


def _value(m: dict, key: str, legacy: bool):
    """``key`` of one metrics line; on a ``legacy`` line a bare name is the validation's, and the training
    rollouts' value of that step is lost."""
    if key == "val-core":
        return next((x for k, x in m.items() if k.startswith("val-core/") and "/acc/mean@" in k), None)
    if key.startswith("val-aux/"):
        return m.get(key[len("val-aux/"):]) if legacy else m.get(key)
    return None if legacy else m.get(key)


def mechanism_series(metrics: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(step, value), ...]}`` of :data:`MECHANISM` from a run's metrics lines."""
    out: dict[str, list[tuple[int, float]]] = {}
    for m in metrics:
        if not finite_number(m.get("step")):
            continue
        legacy = _legacy(m)
        for key, _ in MECHANISM:
            v = _value(m, key, legacy)
            if finite_number(v):
                out.setdefault(key, []).append((int(m["step"]), float(v)))
    return out


def _first_last(g: dict, key: str, window: int) -> tuple[list[float], list[float]]:
    """Each seed's mean over its first and its last ``window`` logged steps of ``key`` (at most half its
    points each); seeds with fewer than two points are left out."""
    firsts, lasts = [], []
    for s in g["seeds"].values():
        pts = sorted(s.get("series", {}).get(key, []))
        if len(pts) >= 2:
            w = max(1, min(window, len(pts) // 2))
            firsts.append(float(np.mean([v for _, v in pts[:w]])))
            lasts.append(float(np.mean([v for _, v in pts[-w:]])))
    return firsts, lasts


def mechanism_table(data: dict, window: int = 10) -> list[dict]:
    """Per arm and :data:`MECHANISM` metric: the mean over seeds of each seed's mean over its first and its
    last ``window`` logged steps, and the seeds' change (last − first) with its min and max; [] when no
    run logged a metric at two steps or more."""
    rows = []
    for k, g in data["groups"].items():
        for key, title in MECHANISM:
            firsts, lasts = _first_last(g, key, window)
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


def _phase_means(g: dict, key: str, edges: np.ndarray) -> list[list[float]]:
    """Per phase ``(edges[i], edges[i + 1]]`` of steps: each seed's mean of ``key`` over its steps there."""
    out: list[list[float]] = [[] for _ in range(len(edges) - 1)]
    for s in g["seeds"].values():
        pts = s.get("series", {}).get(key, [])
        for i in range(len(edges) - 1):
            vals = [v for step, v in pts if edges[i] < step <= edges[i + 1]]
            if vals:
                out[i].append(float(np.mean(vals)))
    return out


def _contrast(a: list[float], b: list[float]) -> dict | None:
    if not a or not b:
        return None
    return {"diff": float(np.mean(a) - np.mean(b)), "p": seed_permutation_test(a, b), "seeds": (len(a), len(b))}


def _single_session(g: dict) -> bool:
    """Every trajectory of every seed one session (a single-session floor: no sessions to allocate, and an
    arm-against-arm contrast with it says only that)."""
    vals = [v for s in g["seeds"].values() for key in ("session/per_traj/success", "session/per_traj/failure")
            for _, v in s.get("series", {}).get(key, [])]
    return bool(vals) and all(v == 1.0 for v in vals)


def mechanism_contrast(data: dict, phases: int = 4, window: int = 10) -> list[dict]:
    """For each pair of multi-session arms of one setting (``arm/setting`` keys, in grid order: first −
    second) and each :data:`MECHANISM` metric: per phase of training (the logged steps cut into ``phases``
    equal spans) the difference of the arms' mean level over seeds, and the difference of the seeds' change
    (last ``window`` steps − first), each with the permutation p over seeds (exact up to 200,000 splits);
    the change's p also Holm-adjusted over the pair's metrics. [] when no pair of arms logged them."""
    keys = [k for k, g in data["groups"].items() if not _single_session(g)]
    pairs = [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:] if a.split("/", 1)[1:] == b.split("/", 1)[1:]]
    rows = []
    for a, b in pairs:
        ga, gb = data["groups"][a], data["groups"][b]
        block = []
        for key, title in MECHANISM:
            steps = [st for g in (ga, gb) for s in g["seeds"].values() for st, _ in s.get("series", {}).get(key, [])]
            if not steps:
                continue
            edges = np.linspace(min(steps) - 1, max(steps), phases + 1)
            per = [_contrast(x, y) for x, y in zip(_phase_means(ga, key, edges), _phase_means(gb, key, edges))]
            (fa, la), (fb, lb) = _first_last(ga, key, window), _first_last(gb, key, window)
            change = _contrast(list(np.subtract(la, fa)), list(np.subtract(lb, fb)))
            if not change and not any(per):
                continue  # neither a level nor a change both arms logged (gains only one arm scores)
            block.append({"a": a, "b": b, "metric": key, "title": title, "phases": per, "change": change,
                          "spans": [(int(edges[i]) + 1, int(edges[i + 1])) for i in range(phases)]})
        tested = [r for r in block if r["change"]]
        for r, p in zip(tested, holm([r["change"]["p"] for r in tested]) if tested else []):
            r["change"]["p_holm"] = p
        rows += block
    return rows


def _cell(c: dict | None) -> str:
    return "–" if c is None else f"{c['diff']:+.3f} (p {c['p']:.2g})"


def md_contrast(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    n = len(rows[0]["spans"])
    out = ["### The mechanism, arm against arm", "",
           f"A − B of the mean over seeds per phase of training (the steps a metric was logged at, cut into {n} "
           "equal spans: the column `steps` gives them; the validation's only where it ran), and of the seeds' "
           "change from their first to their last 10 logged steps. "
           "**The unit is the training seed**: p is the permutation test over the per-seed values (exact: every "
           "split of the pooled seeds, so with S_a and S_b seeds never below 2 / C(S_a + S_b, S_a); past 200,000 "
           "splits, 100,000 random ones, p ≥ 1e-05); the change's p also Holm-adjusted over the metrics of the "
           "pair.", "",
           "| A − B | metric | steps | " + " | ".join(f"phase {i + 1}" for i in range(n)) + " | change, p (Holm) |",
           "| --- | --- | --- | " + " | ".join("---" for _ in range(n)) + " | --- |"]
    for r in rows:
        ch = r["change"]
        change = "–" if ch is None else f"{ch['diff']:+.3f}, p {ch['p']:.2g} ({ch.get('p_holm', ch['p']):.2g})"
        spans = ", ".join(f"{lo}–{hi}" for lo, hi in r["spans"])
        out.append(f"| {r['a']} − {r['b']} | {r['title']} | {spans} | " + " | ".join(_cell(c) for c in r["phases"])
                   + f" | {change} |")
    return out + [""]
