"""Rollout and session metrics with stable, verl-style names.

Names used across the trainer (console, JSONL, TensorBoard, plots):

| name | meaning |
| --- | --- |
| ``critic/score/mean`` (``/max``, ``/min``) | outcome reward of the batch's trajectories |
| ``critic/success/mean`` | share of successful trajectories |
| ``actor/pg_loss``, ``actor/entropy``, ``actor/grad_norm``, ``actor/lr`` | update (from the loss) |
| ``timing_s/gen``, ``timing_s/score``, ``timing_s/update``, ``timing_s/step`` | wall seconds |
| ``perf/throughput`` | tokens (prompt + completion of every row) per second of step time |
| ``session/per_traj`` | sessions per trajectory (mean) |
| ``session/count/<kind>`` | sessions of a kind per trajectory (mean) |
| ``session/gain/<kind>`` | mean information gain of non-final sessions of a kind |
| ``session/pos_gain_share/<kind>`` | share of non-final sessions of a kind with gain > 0 |
| ``session/compactions``, ``session/forks`` | per trajectory (mean) |
| ``session/end/<reason>`` | share of trajectories ending for each reason |
| ``response_length/mean`` | trainable (sampled) tokens per trajectory |
| ``val/accuracy`` (``_lo``, ``_hi``) | held-out accuracy and its 95 % CI |
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mosaic.trace.graph import Trajectory

__all__ = ["rollout_metrics", "CONSOLE_ORDER"]

CONSOLE_ORDER = (
    "critic/score/mean", "critic/success/mean", "val/accuracy", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
    "actor/lr", "session/per_traj", "session/compactions", "session/forks", "timing_s/step", "timing_s/gen",
    "timing_s/score", "timing_s/update", "perf/throughput",
)  # fmt: skip
"""Keys printed first on the console line (others follow alphabetically)."""


def rollout_metrics(trajs: Sequence[Trajectory], gains=None, is_final=None) -> dict[str, float]:
    """Batch metrics of a list of trajectories; ``gains``/``is_final`` (S,) in flatten order when scored."""
    if not trajs:
        return {}
    r = np.array([t.reward for t in trajs], dtype=np.float64)
    m: dict[str, float] = {
        "critic/score/mean": float(r.mean()),
        "critic/score/max": float(r.max()),
        "critic/score/min": float(r.min()),
        "critic/success/mean": float(np.mean([t.success for t in trajs])),
        "session/per_traj": float(np.mean([len(t.sessions) for t in trajs])),
        "response_length/mean": float(np.mean([sum(s.num_trainable for s in t.sessions) for t in trajs])),
    }
    kinds = sorted({s.kind for t in trajs for s in t.sessions} | {"main", "compaction", "subagent"})
    for k in kinds:
        m[f"session/count/{k}"] = float(np.mean([t.count_kinds().get(k, 0) for t in trajs]))
    m["session/compactions"] = m["session/count/compaction"]
    m["session/forks"] = m["session/count/subagent"]
    ends: dict[str, int] = {}
    for t in trajs:
        ends[t.end_reason or "unknown"] = ends.get(t.end_reason or "unknown", 0) + 1
    for reason, n in ends.items():
        m[f"session/end/{reason}"] = n / len(trajs)
    if gains is not None:
        g = np.asarray(gains, dtype=np.float64)
        fin = np.asarray(is_final, dtype=bool) if is_final is not None else np.array(
            [s.is_final for t in trajs for s in t.sessions])
        sk = np.array([s.kind for t in trajs for s in t.sessions])
        if g.shape != sk.shape:
            raise ValueError(f"gains has {g.shape[0]} entries for {sk.shape[0]} sessions")
        for k in kinds:
            sel = (sk == k) & ~fin
            if sel.any():
                m[f"session/gain/{k}"] = float(g[sel].mean())
                m[f"session/pos_gain_share/{k}"] = float((g[sel] > 0).mean())
        live = ~fin
        if live.any():
            m["session/pos_gain_share/all"] = float((g[live] > 0).mean())
    return m
