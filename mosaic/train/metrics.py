"""Rollout and session metrics with stable names: verl's where the quantity is the same.

Names used across the trainer (console, JSONL, TensorBoard, wandb, plots):

| name | meaning |
| --- | --- |
| ``critic/score/mean`` (``/max``, ``/min``) | outcome reward of the batch's trajectories |
| ``critic/success/mean`` | share of successful trajectories |
| ``actor/pg_loss``, ``actor/entropy``, ``actor/grad_norm``, ``actor/lr`` | update (from the loss) |
| ``timing_s/gen``, ``timing_s/score``, ``timing_s/update_actor``, ``timing_s/step`` | wall seconds (``score``:
the information-gain probes, which verl does not have, including those run live during the rollout, which
``gen`` then leaves out) |
| ``timing_s/score_live``, ``score/live_states``, ``score/live_missed`` | the probes run off the rollout's own
KV cache: seconds, states scored, states it could not reach (scored after the rollout instead) |
| ``score/probes``, ``score/unique_states``, ``score/tokens_encoded`` | gain-scorer work, both passes |
| ``perf/throughput`` | tokens (prompt + completion of every row) per second of step time |
| ``session/per_traj`` | sessions per trajectory (mean) |
| ``session/count/<kind>`` | sessions of a kind per trajectory (mean) |
| ``session/per_traj/success``, ``/failure``; ``session/count/<kind>/success``, ``/failure`` | the same over
successful and failed trajectories apart (absent when the batch has none of them) |
| ``groups/all_fail_share``, ``groups/all_success_share``, ``groups/mixed_share`` | how the batch's GRPO groups
split by outcome (only mixed groups carry a trajectory advantage) |
| ``session/gain/<kind>`` | mean information gain of non-final sessions of a kind |
| ``session/pos_gain_share/<kind>`` | share of non-final sessions of a kind with gain > 0 |
| ``session/pos_downstream_share/<kind>`` | the same for the downstream credit (``mosaic-dag``, docs/algorithm.md §4.10) |
| ``session/no_reference_share``, ``score/groups_without_reference`` | ``algo.gain_reference=group``: share of the
batch's sessions (final ones included) in groups with no success, so no probe target; the number of such groups
(docs/algorithm.md §4.11) |
| ``session/compactions``, ``session/forks`` | per trajectory (mean) |
| ``session/subagent_result_in_final`` | of the helpers' sessions, the share whose result is still in the final
state (not dropped by a later compaction, not aborted; from the graph, no model) |
| ``env/stale_rate``, ``env/stale_actions``, ``env/actions``, ``env/visits_correct``, ``env/state_match``,
``env/answer_correct``, ``env/tool_errors`` | the service family's outcome per batch (stale actions per mutating
action, pooled; mutating actions per trajectory) |
| ``reset/resets``, ``reset/notes_written``, ``reset/workspace_full``, ``reset/partner_sessions``,
``reset/partner_tokens`` | ``harness.mode=reset``, per trajectory: resets, notes kept, notes refused for the
workspace's size, sessions a frozen or expert partner played (no training rows) and the tokens they sampled |
| ``dag/*``, ``timing_s/score_downstream`` | the downstream credit's work (``mosaic-dag``, docs/algorithm.md §4.10) |
| ``capo/action_token_share``, ``capo/action_unit_share`` | ``algo.capo``: share of trained tokens that are action
labels, of routed units in the action partition (docs/algorithm.md §5.1) |
| ``session/end/<reason>`` | share of trajectories ending for each reason |
| ``response_length/mean`` | trainable (sampled) tokens per trajectory |
| ``val-core/<family>/acc/mean@<n>`` | held-out accuracy over n samples per question (verl's name; ``<family>``: the
task family, ``data.family``: ``deepsearch`` or ``service``) |
| ``val-aux/<family>/acc/ci_lo@<n>``, ``ci_hi@<n>`` | its 95 % interval |
| ``val-core/<family>-<split>/acc/mean@<n>`` (and its ``val-aux/`` interval) | the warm start's (step 0) and the final
model's evaluation on ``train.heldout_split``: to TensorBoard, wandb and the console, not ``metrics.jsonl`` |
| ``val-aux/<name>`` | on a step with the periodic validation (``train.eval_every``): any name above measured on
the validation rollouts (e.g. ``val-aux/session/pos_gain_share/all``), beside the training rollouts' own |

Run dirs written before the verl names (``timing_s/update``, ``val/accuracy`` and its ``_lo`` / ``_hi``)
are read under the new names: :func:`upgrade_names` (applied by ``runlog.read_metrics``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mosaic.agent.reset import reset_counts
from mosaic.trace.graph import Trajectory

__all__ = ["rollout_metrics", "CONSOLE_ORDER", "VAL_SOURCE", "val_keys", "ci_keys", "upgrade_names", "as_val_aux"]

VAL_SOURCE = "deepsearch"
"""The default data source in verl's validation names (``val-core/<source>/...``): the task family
(``data.family``); runs before the service family named every evaluation so."""


def val_keys(samples: int, source: str = VAL_SOURCE) -> tuple[str, str, str]:
    """(accuracy, 95 % CI low, high) names of a held-out evaluation with ``samples`` per question on the task
    family ``source``."""
    return (f"val-core/{source}/acc/mean@{samples}", f"val-aux/{source}/acc/ci_lo@{samples}",
            f"val-aux/{source}/acc/ci_hi@{samples}")


def as_val_aux(metrics: dict[str, float]) -> dict[str, float]:
    """A periodic validation's metrics as logged beside a training step: the accuracy names as they are, every
    rollout metric under ``val-aux/`` so it never overwrites the training rollouts' metric of the same name
    (runs before this logged them bare, over the training step's: ``mechanism.mechanism_series`` tells them
    apart by the step's ``val-core/`` name)."""
    return {k if k.startswith(("val-core/", "val-aux/")) else f"val-aux/{k}": v for k, v in metrics.items()}


def ci_keys(key: str) -> tuple[str, str] | None:
    """The CI bound names of an accuracy name of :func:`val_keys`; None for any other name."""
    if not key.startswith("val-core/") or "/acc/mean@" not in key:
        return None
    aux = key.replace("val-core/", "val-aux/", 1)
    return aux.replace("/acc/mean@", "/acc/ci_lo@"), aux.replace("/acc/mean@", "/acc/ci_hi@")


_RENAMED = {"timing_s/update": "timing_s/update_actor", **dict(zip(("val/accuracy", "val/accuracy_lo",
                                                                    "val/accuracy_hi"), val_keys(1)))}
"""Names of metrics lines written before the verl names; the periodic evaluation then used 1 sample."""


def upgrade_names(row: dict) -> dict:
    """``row`` (one ``metrics.jsonl`` line) with pre-verl metric names renamed (a new dict when any was)."""
    if not any(k in row for k in _RENAMED):
        return row
    return {_RENAMED.get(k, k): v for k, v in row.items()}


CONSOLE_ORDER = (
    "critic/score/mean", "critic/success/mean", val_keys(1)[0], "actor/pg_loss", "actor/entropy",
    "actor/grad_norm", "actor/lr", "session/per_traj", "session/compactions", "session/forks", "timing_s/step",
    "timing_s/gen", "timing_s/score", "timing_s/update_actor", "perf/throughput",
)  # fmt: skip
"""Keys printed first on the console line (others follow alphabetically)."""


def _outcome_split(trajs: Sequence[Trajectory], kinds: list[str]) -> dict[str, float]:
    """Sessions per trajectory for successes and failures apart (per kind too), and how the GRPO groups
    split: all failed, all succeeded, mixed. Mosaic's trajectory term asks successes for fewer sessions
    and failures for more; it can only act in mixed groups (an all-fail or all-success group has zero
    advantage under group normalisation), so the mixed share bounds how much it can move."""
    m: dict[str, float] = {}
    for name, keep in (("success", True), ("failure", False)):
        sel = [t for t in trajs if bool(t.success) == keep]
        if not sel:
            continue
        m[f"session/per_traj/{name}"] = float(np.mean([len(t.sessions) for t in sel]))
        for k in kinds:
            m[f"session/count/{k}/{name}"] = float(np.mean([t.count_kinds().get(k, 0) for t in sel]))
    groups: dict[str, list[bool]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(bool(t.success))
    if groups:
        n = len(groups)
        m["groups/all_fail_share"] = sum(not any(g) for g in groups.values()) / n
        m["groups/all_success_share"] = sum(all(g) for g in groups.values()) / n
        m["groups/mixed_share"] = 1.0 - m["groups/all_fail_share"] - m["groups/all_success_share"]
    return m


def _env_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """The service family's outcome (``traj.meta["env"]``, docs/service.md): ``env/stale_rate`` (stale
    actions per mutating action, pooled over the batch; 0 when nothing was changed: see ``env/actions``),
    ``env/stale_actions`` and ``env/actions`` (mutating actions; per trajectory),
    ``env/visits_correct`` (share of visits handled right), ``env/state_match``, ``env/answer_correct``,
    ``env/tool_errors`` (per trajectory). Nothing for deep search (no such record)."""
    from mosaic.envs.service.rewards import outcome_summary

    envs = [t.meta["env"] for t in trajs if isinstance(t.meta.get("env"), dict)]
    return {f"env/{k}": v for k, v in outcome_summary(envs).items()}


def _results_in_final(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``session/subagent_result_in_final``: of the helpers' sessions, the share whose result is still in the
    final state's tokens (not dropped by a later compaction, not aborted; docs/algorithm.md §4.10), from the
    graph alone (no model)."""
    from mosaic.train.downstream import plan_downstream  # (torch-free planning; loaded only here)

    n = reach = 0
    for t in trajs:
        helpers = [s.id for s in t.sessions if s.kind == "subagent"]
        if not helpers:
            continue
        n += len(helpers)
        reach += sum(1 for a in plan_downstream(t, ()).ablations if a.session in helpers)
    return {"session/subagent_result_in_final": reach / n} if n else {}


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
    m.update(_outcome_split(trajs, kinds))
    m.update(_results_in_final(trajs))
    m.update(_env_metrics(trajs))
    m.update({f"reset/{k}": v for k, v in reset_counts(trajs).items()})
    # drift repairs (captured rollouts whose harness re-sent a turn differently): stretches trained apart
    m["rollout/drift_repairs"] = float(sum(len(s.detached) for t in trajs for s in t.sessions))
    m["rollout/drift_detached_tokens"] = float(sum(sum(x.loss_mask) for t in trajs for s in t.sessions
                                                   for x in s.detached))
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
