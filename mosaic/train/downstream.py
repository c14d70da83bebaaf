"""Downstream session credit (docs/algorithm.md §4.10) and gains without a reference answer (§4.11).

A session's immediate gain (§4.4) is measured where the session ends: a subagent's in its parent right
after its result is merged. Under forks the two can disagree: a later compaction may drop the result, or
the final answer may rest on another branch. The *downstream credit* ``D`` measures each session's effect
on the **final state** — the final session's context when the answer turn began (its whole context when
the trajectory ended without an answer):

* a session whose output is in the final state is **ablated** there: a subagent's merged result replaced by
  an empty result (``meta["merged_at"]``, recorded by the harness), a compaction's summary (or a reset's
  notes) — the final session's prompt — replaced by the bare task prompt (the root session's prompt).
  ``D = L(final) − L(final, ablated)``; every ablation shares the final state's KV cache up to where the
  two sequences part, so it costs the tail's re-encoding and one probe.
* a session whose output reaches the final state only through another session — its *consumer*: a
  subagent's parent, a main session's compaction, a compaction's (or reset's) next session — inherits a
  share of its consumer's credit: ``D_k = s_k · D_c`` with ``s_k = g_k⁺ / Σ g_j⁺`` over the consumer's inputs
  ``j`` when ``D_c >= 0`` (their positive immediate gains), ``g_k⁻ / Σ g_j⁻`` when ``D_c < 0`` (blame to
  the inputs that lowered the likelihood); equal shares when no gain has that sign. The shares of a
  consumer's inputs sum to 1: propagation conserves credit along each edge.
* a session whose output never reaches the final state (an aborted subagent, a record without the span)
  gets ``D = 0``, counted.

The estimator ``mosaic-dag`` z-scores ``D`` per kind as ``mosaic`` does ``g`` (§4.5 holds unchanged).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

import torch

from mosaic.agent.chat import ProbeFn
from mosaic.agent.policies.sampling import common_prefix
from mosaic.envs.rewards import normalize_answer
from mosaic.trace.graph import Session, Trajectory
from mosaic.trace.rows import turn_boundaries
from mosaic.train.probes import Host, ScoreStats, eval_mode, extend_cache, run_from_caches, run_reference

__all__ = ["Ablation", "DownstreamPlan", "DownstreamResult", "final_state_cut", "plan_downstream", "propagate",
           "score_downstream", "downstream_from_logprobs", "group_references", "with_references", "PROMPT_OUTPUT_KINDS"]

PROMPT_OUTPUT_KINDS = ("compaction", "reset")
"""Kinds whose output is the next session's prompt (a summary, the notes): ablated by the bare task prompt."""


@dataclass(frozen=True)
class Ablation:
    """Session ``session``'s output in the final state: tokens ``[start, end)`` replaced by ``replacement``."""

    session: int
    start: int
    end: int
    replacement: tuple[int, ...]


@dataclass
class DownstreamPlan:
    """One trajectory's downstream credit, before any model runs."""

    final: int
    """The final session's id."""
    final_cut: int
    """Length of the final state (a prefix of the final session's tokens)."""
    ablations: list[Ablation] = field(default_factory=list)
    consumer: dict[int, int] = field(default_factory=dict)
    """Non-final session -> the session its output flows into (absent: it reaches no one)."""
    missing: list[int] = field(default_factory=list)
    """Sessions that feed the final session but whose output could not be located (no span recorded)."""

    def sequence(self, traj: Trajectory, ab: Ablation) -> list[int]:
        """The final state with ``ab`` applied."""
        f = traj.sessions[self.final].tokens()[: self.final_cut]
        return f[: ab.start] + list(ab.replacement) + f[ab.end :]


def final_state_cut(traj: Trajectory, header_ids: Sequence[int] | None = None) -> int:
    """Length of the final state: the final session's context at the boundary before its answer turn when
    the trajectory was answered, else its context at its end (both without a generation header)."""
    f = traj.final_session()
    cuts = turn_boundaries(f, header_ids)
    if traj.end_reason == "answer" and len(cuts) >= 2:
        return cuts[-2]
    return cuts[-1]


def _next_of(traj: Trajectory, k: int) -> int | None:
    for s in traj.sessions:
        if s.parent == k and s.edge == "continues":
            return s.id
    return None


def _span(s: Session, n: int) -> tuple[int, int] | None:
    v = s.meta.get("merged_at")
    if (isinstance(v, (list, tuple)) and len(v) == 2 and all(type(x) is int for x in v)
            and 0 <= v[0] < v[1] <= n):  # fmt: skip
        return int(v[0]), int(v[1])
    return None


def plan_downstream(traj: Trajectory, empty_result_ids: Sequence[int],
                    header_ids: Sequence[int] | None = None) -> DownstreamPlan:  # fmt: skip
    """Who feeds whom, and the ablations in the final state (no model: token bookkeeping only)."""
    fin = traj.final_session()
    cut = final_state_cut(traj, header_ids)
    plan = DownstreamPlan(final=fin.id, final_cut=cut)
    root = traj.sessions[0]
    rb = root.state_before
    bare = None
    if rb is not None and rb.session == root.id and rb.state is None and rb.upto:
        bare = tuple(root.tokens()[: rb.upto])
    k = fin.meta.get("bare_state")  # reset mode with roles: the final session's own role, an empty workspace
    if type(k) is int and 0 <= k < len(traj.states):
        bare = tuple(traj.states[k])
    for s in traj.sessions:
        if s.is_final:
            continue
        if s.edge == "forks":  # a helper: its result is merged into its parent
            if s.end_reason == "aborted" or s.meta.get("aborted") or \
                    ("merged_at" not in s.meta and s.state_after == s.state_before):  # fmt: skip
                continue  # ended with the trajectory: its result never reached the parent
            c = s.parent
            if c != fin.id:
                plan.consumer[s.id] = c
                continue
            span = _span(s, cut)
            if span is None:  # (a record without the span, e.g. from an older harness)
                plan.missing.append(s.id)
                continue
            plan.ablations.append(Ablation(s.id, span[0], span[1], tuple(empty_result_ids)))
            continue
        nxt = _next_of(traj, s.id)
        if nxt is None:
            continue
        if s.kind in PROMPT_OUTPUT_KINDS and nxt == fin.id:
            nb = fin.state_before
            if bare is None or nb is None or nb.session != fin.id or nb.state is not None or not nb.upto \
                    or nb.upto > cut:  # fmt: skip
                plan.missing.append(s.id)
                continue
            plan.ablations.append(Ablation(s.id, 0, nb.upto, bare))
            continue
        plan.consumer[s.id] = nxt
    return plan


def propagate(plan: DownstreamPlan, direct: dict[int, float], gains: Sequence[float], n: int) -> list[float]:
    """Per session (``n`` of them) the downstream credit: ``direct`` where ablated, else a share of the
    consumer's credit — credit (``D_c >= 0``) shared by the inputs' positive immediate gains, blame
    (``D_c < 0``) by their negative ones (``gains``, per session id); equal shares when no input's gain
    has that sign; 0 where nothing flows."""
    inputs: dict[int, list[int]] = {}
    for k, c in plan.consumer.items():
        inputs.setdefault(c, []).append(k)
    memo: dict[int, float] = {}

    def credit(k: int, depth: int = 0) -> float:
        if k in memo:
            return memo[k]
        if k in direct:
            v = float(direct[k])
        elif k in plan.consumer and depth <= n:
            c = plan.consumer[k]
            dc = credit(c, depth + 1)
            sign = 1.0 if dc >= 0 else -1.0  # credit goes to the inputs that raised L, blame to those that lowered it
            part = [max(sign * float(gains[j]), 0.0) for j in inputs[c]]
            tot = sum(part)
            share = part[inputs[c].index(k)] / tot if tot > 0 else 1.0 / len(inputs[c])
            v = share * dc
        else:
            v = 0.0
        memo[k] = v
        return v

    return [0.0 if k == plan.final else credit(k) for k in range(n)]


@dataclass
class DownstreamResult:
    """Downstream credit of a batch, in :func:`mosaic.trace.flatten` order (S sessions)."""

    downstream: torch.Tensor
    """(S,) float32 ``D``; 0 for final sessions and sessions whose output reaches nothing."""
    how: list[str]
    """(S,) ``direct`` | ``propagated`` | ``none`` | ``missing`` | ``final``: how each ``D`` was obtained."""
    loglik_final: torch.Tensor
    """(T,) ``L(final state)``; NaN where the trajectory needed no probe."""
    stats: ScoreStats
    metrics: dict[str, float]


def _encode_row(model, tokens: list[int], stats: ScoreStats):
    dev = next(model.parameters()).device
    out = model.get_decoder()(input_ids=torch.tensor([tokens], device=dev), use_cache=True)
    stats.forward_calls += 1
    stats.tokens_encoded += len(tokens)
    return [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]


def _probe_jobs(trajs, plans, model, probe_fn, method: str, stats: ScoreStats):
    """The sequences to probe — per trajectory with an ablation, its final state then each ablated one — as
    hosts (and, ``cached``, each one's KV cache: the final state's, extended from where they part)."""
    probes: dict[str, tuple] = {}
    hosts: list[Host] = []
    caches: list = []
    where: list[tuple[int, int | None]] = []  # (traj, ablated session or None for the final state)
    for i, (t, p) in enumerate(zip(trajs, plans)):
        if not p.ablations or t.ground_truth is None:
            continue
        if t.ground_truth not in probes:
            probes[t.ground_truth] = probe_fn(t.ground_truth)
        final = t.sessions[p.final].tokens()[: p.final_cut]
        kv = _encode_row(model, final[:-1], stats) if method == "cached" else None
        for sid, seq in [(None, final)] + [(ab.session, p.sequence(t, ab)) for ab in p.ablations]:
            hosts.append(Host(tokens=seq, cuts=[len(seq)], probe=probes[t.ground_truth]))
            where.append((i, sid))
            if kv is None:
                continue
            shared = min(common_prefix(final, seq, len(seq)), len(seq) - 1, len(final) - 1)
            caches.append(_encode_row(model, seq[:-1], stats) if shared < 1 else
                          extend_cache(model, seq, [(K[:, :shared], V[:, :shared]) for K, V in kv], len(seq) - 1,
                                       stats))  # fmt: skip
    return hosts, caches, where


def _how(t: Trajectory, p: DownstreamPlan, direct: dict[int, float]) -> list[str]:
    out = []
    for k in range(len(t.sessions)):
        if k == p.final:
            out.append("final")
        elif t.ground_truth is None:  # (a group without a success under algo.gain_reference=group)
            out.append("no_reference")
        elif k in direct:
            out.append("direct")
        elif k in p.missing:
            out.append("missing")
        else:
            out.append("propagated" if k in p.consumer else "none")
    return out


def score_downstream(
    trajs: Sequence[Trajectory],
    model,
    probe_fn: ProbeFn,
    gains: Sequence[float] | torch.Tensor,
    *,
    empty_result_ids: Sequence[int],
    header_ids: Sequence[int] | None = None,
    method: Literal["cached", "reference"] = "cached",
    max_batch_tokens: int = 16384,
    max_batch_size: int = 64,
) -> DownstreamResult:
    """Downstream credit of every session of ``trajs`` (docs/algorithm.md §4.10), with ``model`` (the rollout
    policy, no gradient). ``gains``: (S,) immediate gains in flatten order (the propagation's shares);
    trajectories whose ``ground_truth`` is None get no probe (their ``D`` is 0, ``how`` = ``no_reference``).
    ``cached``: the final state encoded once per trajectory, every ablation extends its cache from where they
    part; ``reference``: every sequence re-encoded from scratch (the tests hold the two together)."""
    t0 = time.perf_counter()
    g = torch.as_tensor(gains, dtype=torch.float64).tolist()
    n_sess = sum(len(t.sessions) for t in trajs)
    if method not in ("cached", "reference") or len(g) != n_sess:
        raise ValueError(f"method must be 'cached' or 'reference' (got {method!r}) and gains one per session "
                         f"(got {len(g)} for {n_sess})")
    stats = ScoreStats()
    plans = [plan_downstream(t, empty_result_ids, header_ids) for t in trajs]
    with eval_mode(model), torch.inference_mode():
        hosts, caches, where = _probe_jobs(trajs, plans, model, probe_fn, method, stats)
        if not hosts:
            L = []
        elif method == "cached":
            L = run_from_caches(model, hosts, caches, stats, max_batch_tokens=max_batch_tokens,
                                max_batch_size=max_batch_size)  # fmt: skip
        else:
            L = run_reference(model, hosts, stats)
    lfinal = torch.full((len(trajs),), float("nan"))
    direct: list[dict[int, float]] = [dict() for _ in trajs]
    for (i, sid), h, vals in zip(where, hosts, L):
        if sid is None:  # (each trajectory's final state comes before its ablations)
            lfinal[i] = vals[len(h.tokens)]
        else:
            direct[i][sid] = float(lfinal[i]) - vals[len(h.tokens)]
    out: list[float] = []
    how: list[str] = []
    off = 0
    for i, (t, p) in enumerate(zip(trajs, plans)):
        n = len(t.sessions)
        out.extend(propagate(p, direct[i], g[off : off + n], n) if t.ground_truth is not None else [0.0] * n)
        how.extend(_how(t, p, direct[i]))
        off += n
    stats.num_probes = stats.num_unique_states = len(hosts)
    stats.seconds = time.perf_counter() - t0
    return DownstreamResult(downstream=torch.tensor(out, dtype=torch.float32), how=how, loglik_final=lfinal,
                            stats=stats, metrics=_dag_metrics(trajs, how, stats, len(hosts)))


def _dag_metrics(trajs: Sequence[Trajectory], how: list[str], stats: ScoreStats, probes: int) -> dict[str, float]:
    c = Counter(how)
    metrics = {"timing_s/score_downstream": stats.seconds, "dag/probes": float(probes),
               "dag/tokens_encoded": float(stats.tokens_encoded),
               **{f"dag/{key}": float(c.get(key, 0)) for key in ("direct", "propagated", "missing", "none",
                                                                 "no_reference")}}
    # helpers of probed trajectories (no_reference: whether their result is in F was not looked at)
    sub = [h for h, s in zip(how, (s for t in trajs for s in t.sessions)) if s.kind == "subagent" and h != "no_reference"]
    if sub:  # a helper's result in the final state's tokens (not dropped by a compaction, not aborted)
        metrics["dag/subagent_result_in_final_share"] = sum(h == "direct" for h in sub) / len(sub)
    return metrics


async def downstream_from_logprobs(traj: Trajectory, probe, logprob_fn, gains: Sequence[float], *,
                                   empty_result_ids: Sequence[int],
                                   header_ids: Sequence[int] | None = None) -> list[float]:  # fmt: skip
    """(S,) downstream credit of one trajectory from a server's prompt log-probs (the verl agent loop):
    ``logprob_fn(ids) -> per-token log-probs`` (awaitable), ``probe`` from ``ChatFormat.answer_probe``,
    ``gains`` (S,) its immediate gains by session id. The same plan and propagation as :func:`score_downstream`;
    the final state and its ablations are requested concurrently."""
    import asyncio

    n = len(traj.sessions)
    plan = plan_downstream(traj, empty_result_ids, header_ids)
    if not plan.ablations:
        return propagate(plan, {}, gains, n)
    suffix, (a, b) = probe

    async def loglik(ctx: list[int]) -> float:
        ids = list(ctx) + list(suffix)
        lp = await logprob_fn(ids)
        if len(lp) != len(ids):
            raise ValueError(f"logprob_fn returned {len(lp)} values for {len(ids)} tokens")
        span = lp[len(ctx) + a : len(ctx) + b]
        return float(sum(span) / len(span))

    final = traj.sessions[plan.final].tokens()[: plan.final_cut]
    vals = await asyncio.gather(loglik(final), *(loglik(plan.sequence(traj, ab)) for ab in plan.ablations))
    direct = {ab.session: vals[0] - v for ab, v in zip(plan.ablations, vals[1:])}
    return propagate(plan, direct, gains, n)


# --------------------------------------------------------------------------------------
# §4.11: the probe's target from the group instead of a reference answer.


def group_references(trajs: Sequence[Trajectory]) -> dict[str, str | None]:
    """Per group, the final answer of its successful trajectories (the most frequent one, answers compared
    after the reward's normalisation; ties: the first in batch order; the first spelling seen), or None
    when no trajectory of the group succeeded with a non-empty answer."""
    seen: dict[str, Counter] = {}
    first: dict[str, dict[str, tuple[int, str]]] = {}  # normalised answer -> (batch index, raw answer) of its first
    for n, t in enumerate(trajs):
        seen.setdefault(t.group_id, Counter())
        key = normalize_answer(t.answer) if t.success and t.answer else ""
        if key:  # answers that agree after the reward's normalisation are one answer
            seen[t.group_id][key] += 1
            first.setdefault(t.group_id, {}).setdefault(key, (n, t.answer))
    out: dict[str, str | None] = {}
    for gid, cnt in seen.items():
        if not cnt:
            out[gid] = None
            continue
        out[gid] = first[gid][min(cnt, key=lambda a: (-cnt[a], first[gid][a][0]))][1]
    return out


def with_references(trajs: Sequence[Trajectory], refs: dict[str, str | None]) -> list[Trajectory]:
    """Shallow copies of ``trajs`` whose ``ground_truth`` is their group's reference (None where it has none);
    sessions are shared, not copied."""
    return [replace(t, ground_truth=refs.get(t.group_id)) for t in trajs]
