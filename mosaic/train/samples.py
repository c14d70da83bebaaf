"""What ``samples.jsonl`` holds: a few rollouts per step, token for token, with their credit.

One JSON line per sampled trajectory (``train.rollout_samples`` per step), enough for
``mosaic view`` to draw its session graph, its transcript coloured by loss mask and by
advantage, each session's information gain and the advantage every registered estimator
gives it, without a model or a tokenizer::

    {"schema": "mosaic.sample", "schema_version": 1, "step": 3, "trajectory": ..., "task_id": ...,
     "group_id": ..., "reward": 1.0, "success": true, "answer": ..., "ground_truth": ...,
     "end_reason": "answer", "estimator": "mosaic",            # the one the step trained with
     "group": {"size": 8, "mean_reward": 0.375, "successes": 3},  # over the whole batch
     "estimators": ["grpo", "broadcast", ...],                  # the registry, in its order
     "unavailable": {"turn-level": "needs turn_gains (not scored this step)", ...},
     "sessions": [{"id": 0, "kind": "main", "parent": null, "edge": null, "end": "compaction",
                   "final": false, "turns": 3,
                   "prefix": [p, n],          # optional: the prompt starts with the first n tokens of its
                                              # parent p's prompt + completion (stored once; n >= 32)
                   "fork_at": 57,             # optional, a fork: the parent's token count where it left
                   "notes": {"before": [..], "after": [..]},  # optional, a reset session's workspace
                   "role": {"index": 0, "text": "..", "partner": null},  # optional, a reset session's role
                   "prompt": [ids], "completion": [ids],
                   "mask": [runs],            # loss_mask as run lengths, starting with a False run
                   "gain": 0.12,              # L(after) - L(before), nats per answer token; null where not scored
                   "downstream": 0.3,         # optional: the downstream credit D (§4.10), when it was scored
                   "downstream_how": "direct",  # how D was obtained: direct | propagated | missing | none | no_reference
                   "turn_gains": [...],       # per turn, only when scored
                   "adv": {"broadcast": 0.87, "mosaic": 0.91, ...},     # session-level estimators
                   "turn_adv": {"fold": [0.87, -0.13], ...}}]}         # turn-level, one per turn

Token text lives once per run in ``vocab.json`` (``{"pieces": [...]}``, ``tok.decode([id])`` of
every id), so a line is ids, not text. Every estimator is computed on the whole step's batch
(its z-scores and group statistics are the trainer's), for each one whose inputs the step had:
gains exist only when the trained estimator scored them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from mosaic.trace.graph import Trajectory
from mosaic.trace.rows import TurnLayout, turn_layout

if TYPE_CHECKING:  # torch and the estimators load only when records are made, not when they are read
    import torch

    from mosaic.core.estimators import EstimatorParams

__all__ = ["SAMPLE_SCHEMA", "SAMPLE_SCHEMA_VERSION", "all_estimator_advantages", "sample_records", "vocab_pieces",
           "mask_runs"]  # fmt: skip

SAMPLE_SCHEMA = "mosaic.sample"
SAMPLE_SCHEMA_VERSION = 1
_MIN_PREFIX = 32
"""A prompt's shared prefix shorter than this is stored in full (a fork's prompt shares a few template tokens)."""


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def all_estimator_advantages(trajs: Sequence[Trajectory], params: EstimatorParams, *, gains=None, turn_gains=None,
                             layout: TurnLayout | None = None, context_budget: int | Mapping[str, int] | None = None,
                             count_kinds: Sequence[str] | None = None, downstream=None,
                             ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:  # fmt: skip
    """Every registered estimator on one batch: ``({name: (S,) or (U,) advantages}, {name: why not})``.

    For batches no step trained on (``mosaic view`` of a rollouts file); the trainer gets the same from
    :func:`mosaic.train.batch.step_advantages`, which runs each estimator once per step.
    ``gains``, ``downstream``: (S,) in flatten order; ``turn_gains``: (U,) in ``layout`` order; ``context_budget``
    enables the half-budget flags of ``fold``."""
    from mosaic.train.batch import advantage_batch, every_estimator

    layout = layout if layout is not None else turn_layout(trajs)
    batch = advantage_batch(trajs, gains, count_kinds=count_kinds, layout=layout, turn_gains=turn_gains,
                            context_budget=context_budget, downstream=downstream)  # fmt: skip
    return every_estimator(batch, params)


def mask_runs(mask: Sequence[bool]) -> list[int]:
    """Run lengths of a boolean mask, the first run False (so it may be 0)."""
    runs, cur, n = [], False, 0
    for m in mask:
        if bool(m) == cur:
            n += 1
        else:
            runs.append(n)
            cur, n = not cur, 1
    runs.append(n)
    return runs


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _group_stats(trajs: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
    acc: dict[str, list[Trajectory]] = {}
    for t in trajs:
        acc.setdefault(t.group_id, []).append(t)
    return {g: {"size": len(ts), "mean_reward": sum(t.reward for t in ts) / len(ts),
                "successes": sum(bool(t.success) for t in ts)} for g, ts in acc.items()}  # fmt: skip


def _rounded(values) -> list[float]:
    """Six significant digits: the page shows three, and the file stays small."""
    import torch

    return [float(f"{x:.6g}") + 0.0 for x in torch.as_tensor(values, dtype=torch.float64).tolist()]  # (+0.0: no -0.0)


def sample_records(trajs: Sequence[Trajectory], keep: Sequence[int], *, step: int, estimator: str | None,
                   advantages: dict[str, torch.Tensor], unavailable: dict[str, str], gains=None, turn_gains=None,
                   layout: TurnLayout | None = None, downstream=None,
                   downstream_how: Sequence[str] | None = None, gain_valid=None) -> list[dict[str, Any]]:  # fmt: skip
    """The ``samples.jsonl`` lines of trajectories ``keep`` (indices into ``trajs``, the whole batch that
    ``advantages`` (from :func:`all_estimator_advantages`), ``gains`` (S,), ``downstream`` (S,) with
    ``downstream_how`` (S,) and ``turn_gains`` (U,) cover)."""
    from mosaic.core.estimators import ESTIMATORS

    layout = layout if layout is not None else turn_layout(trajs)
    levels = {n: ESTIMATORS[n].level for n in advantages}
    adv = {n: _rounded(v) for n, v in advantages.items()}
    g = None if gains is None else _rounded(gains)
    dn = None if downstream is None else _rounded(downstream)
    valid = None if gain_valid is None else [bool(v) for v in gain_valid.tolist()]
    tg = None if turn_gains is None else _rounded(turn_gains)
    # Offsets of each trajectory's sessions (S order) and each session's turns (U order).
    s_off, k = [], 0
    for t in trajs:
        s_off.append(k)
        k += len(t.sessions)
    u_off = [0] * (k + 1)
    for sess in layout.session.tolist():
        u_off[sess + 1] += 1
    for i in range(k):
        u_off[i + 1] += u_off[i]
    groups = _group_stats(trajs)
    out = []
    for i in keep:
        t = trajs[i]
        sessions = [_session_record(t, sess, s_off[i] + sess.id, u_off, adv, levels, g, tg, dn, downstream_how,
                                    valid) for sess in t.sessions]
        out.append({"schema": SAMPLE_SCHEMA, "schema_version": SAMPLE_SCHEMA_VERSION, "step": int(step),
                    "trajectory": t.id, "task_id": t.task_id, "group_id": t.group_id, "reward": float(t.reward),
                    "success": bool(t.success), "answer": t.answer, "ground_truth": t.ground_truth,
                    "end_reason": t.end_reason, "estimator": estimator, "group": groups[t.group_id],
                    "estimators": list(ESTIMATORS), "unavailable": dict(unavailable),
                    "sessions": sessions})  # fmt: skip
        env = env_outcome(t.meta.get("env"))
        if env:
            out[-1]["env"] = env
    return out


def env_outcome(env: Any) -> dict[str, Any]:
    """The plain fields (numbers, booleans, short strings) of a trajectory's environment outcome (the service
    family's ``traj.meta["env"]``: state match, answer, visits, stale actions…) for a sample record; {} for none."""
    if not isinstance(env, dict):
        return {}
    return {k: v for k, v in env.items() if isinstance(k, str) and (
        isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 200))}


def _session_record(t: Trajectory, s, flat: int, u_off: list[int], adv: dict, levels: dict, g, tg, dn,
                    how, valid) -> dict[str, Any]:  # fmt: skip
    """One session's entry of a ``samples.jsonl`` line (``flat``: its index in the batch's S order)."""
    rec: dict[str, Any] = {"id": s.id, "kind": s.kind, "parent": s.parent, "edge": s.edge,
                           "end": s.end_reason, "final": bool(s.is_final), "turns": s.num_turns}  # fmt: skip
    prompt = list(s.prompt_ids)
    if s.parent is not None:
        n = _shared_prefix(prompt, t.sessions[s.parent].tokens())
        if n >= _MIN_PREFIX:
            rec["prefix"] = [s.parent, n]
            prompt = prompt[n:]
    sb = s.state_before
    if s.edge == "forks" and type(s.meta.get("forked_at")) is int:
        rec["fork_at"] = s.meta["forked_at"]  # where in the parent's tokens it left (the viewer shows the turn)
    elif s.edge == "forks" and sb is not None and sb.session == s.parent and sb.upto is not None:
        rec["fork_at"] = sb.upto  # (records without forked_at: the merge-mode state before is the same point)
    if "notes_before" in s.meta or "notes_after" in s.meta:  # a reset session's workspace (mode=reset)
        rec["notes"] = {"before": _as_list(s.meta.get("notes_before", [])),  # (a hand-edited non-list is
                        "after": _as_list(s.meta.get("notes_after", []))}  # kept as is: the viewer names it)
    if type(s.meta.get("role")) is int:  # one of two alternating roles (harness.reset_roles), who played it
        rec["role"] = {"index": s.meta["role"], "text": str(s.meta.get("role_text", "")),
                       "partner": s.meta.get("partner")}  # fmt: skip
    rec["prompt"] = prompt
    rec["completion"] = list(s.completion_ids)
    rec["mask"] = mask_runs(s.loss_mask)
    unscored = s.is_final or (valid is not None and not valid[flat])  # (§4.11: no answer was probed)
    rec["gain"] = None if g is None or unscored else g[flat]
    if dn is not None and not unscored:  # the downstream credit (§4.10), beside the immediate gain
        rec["downstream"] = dn[flat]
        if how is not None:
            rec["downstream_how"] = str(how[flat])
    ua, ub = u_off[flat], u_off[flat + 1]
    if tg is not None:
        rec["turn_gains"] = tg[ua:ub]
    rec["adv"] = {n: v[flat] for n, v in adv.items() if levels[n] == "session"}
    rec["turn_adv"] = {n: v[ua:ub] for n, v in adv.items() if levels[n] == "turn"}
    return rec


def vocab_pieces(tokenizer) -> list[str]:
    """The text of every token id on its own (``vocab.json``): what the viewer prints for an id."""
    return [tokenizer.decode([i], skip_special_tokens=False) for i in range(len(tokenizer))]
