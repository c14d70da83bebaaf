"""Session states of an external harness's rollouts scored off the served policy's prefix cache.

The built-in harness scores each main session's states live, off the rollout policy's own KV cache, as the
session closes (:class:`~mosaic.train.scorer.LiveScorer`). An external harness's rollouts are rebuilt from
the recording proxy's records after they end, so nothing is known while they run; but the served policy
(:class:`~mosaic.agent.policies.local.LocalPolicy` behind ``mosaic serve``'s app) keeps every request's
context cached, keyed by content, until the weights change. :func:`known_from_cache` reads those caches
after the rollouts, before the update (the same weights), and probes the states they hold; the trainer's
:func:`~mosaic.train.scorer.score_gains` scores the rest (``known=``).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from mosaic.agent.chat import Probe, ProbeFn
from mosaic.trace.graph import Trajectory
from mosaic.train.probes import Host, ScoreStats, eval_mode, extend_cache, run_from_caches
from mosaic.train.scorer import probe_for, state_host

__all__ = ["known_from_cache"]


def _cached_hosts(t: Trajectory, i: int, policy, probe_fn: ProbeFn, probes: dict, max_tail: int, stats: ScoreStats,
                  hosts: list, caches: list, where: list) -> None:
    """Trajectory ``t``'s session-prefix states whose session the policy holds cached: a host (with its
    cache, tail encoded) per session, appended to ``hosts``/``caches``/``where``."""
    if t.ground_truth is None:
        return
    cuts: dict[int, set[int]] = {}
    for s in t.sessions:
        if s.is_final or s.state_before is None or s.state_after is None:
            continue
        for ref in (s.state_before, s.state_after):
            key, cut = state_host(t, ref)
            if key[0] == "session" and cut >= 1:
                cuts.setdefault(key[1], set()).add(cut)
    for sid, cs in cuts.items():
        tokens = t.sessions[sid].tokens()[: max(cs)]
        need = max(cs) - 1
        hit = policy.longest_cached(tokens[:need])
        # only a cache that holds (nearly) the whole state: a shared system prompt alone would mean encoding
        # the session one by one, slower than the batched pass after
        if hit is None or need - hit[0] > max(max_tail, need // 10):
            continue
        hosts.append(Host(tokens=tokens, cuts=sorted(cs), probe=probe_for(t, probe_fn, probes)))
        caches.append(extend_cache(policy.model, tokens, hit[1], need, stats))
        where.append((i, sid))


def known_from_cache(trajs: Sequence[Trajectory], policy, probe_fn: ProbeFn, *, max_tail: int = 64,
                     max_batch_tokens: int = 16384, max_batch_size: int = 64) -> tuple[list, ScoreStats, int]:
    """States scored after the rollouts off a serving policy's prefix cache (an external harness's rollouts,
    whose graphs are rebuilt from records: nothing is known while they run).

    A session whose states the policy still holds cached, but for a tail of at most ``max_tail`` tokens (or a
    tenth of the state), found by :meth:`~mosaic.agent.policies.local.LocalPolicy.longest_cached`, has its
    session-prefix states probed off that cache (the tail encoded first), ``max_batch_tokens`` of copied
    cache at a time; the rest are left to :func:`score_gains`. Returns (``known=`` for :func:`score_gains`,
    the pass's stats, states found)."""
    t0 = time.perf_counter()
    stats = ScoreStats()
    probes: dict[str, Probe] = {}
    known: list[dict | None] = [None] * len(trajs)
    hosts, caches, where = [], [], []
    found = 0
    model = policy.model

    def flush() -> None:
        L = run_from_caches(model, hosts, caches, stats, max_batch_tokens=max_batch_tokens,
                            max_batch_size=max_batch_size)
        for (i, sid), vals in zip(where, L):
            mine = known[i] = known[i] or {}
            for c, v in vals.items():
                mine[(sid, c)] = v
        hosts.clear(), caches.clear(), where.clear()

    with eval_mode(model), torch.inference_mode():
        for i, t in enumerate(trajs):
            n = len(hosts)
            _cached_hosts(t, i, policy, probe_fn, probes, max_tail, stats, hosts, caches, where)
            found += sum(len(h.cuts) for h in hosts[n:])
            if sum(len(h.tokens) for h in hosts) >= max_batch_tokens:
                flush()
        if hosts:
            flush()
    stats.num_unique_states = found
    stats.seconds = time.perf_counter() - t0
    return known, stats, found
