"""Information-gain scorer (docs/algorithm.md §4.4) and the turn-level IGPO-style variant (§4.7).

``L(c)`` is the rollout policy's mean log-probability per token of the ground
truth ``y`` when the context ``c`` is followed by the answer probe (the
assistant turn ``<answer>y</answer>``). A session's gain is
``g = L(state_after) - L(state_before)``; the final session gets 0 and is
flagged (its context holds the answer).

How it is made cheap (:func:`score_gains`):

1. **Dedupe.** States are :class:`~mosaic.trace.graph.StateRef` s; references
   with equal ``Trajectory.state_key`` name the same tokens and are probed once
   (a chain of k compactions needs 2k + 1 probes).
2. **One pass per session, probes off its KV cache.** Every state that is a
   prefix of a session's ``prompt + completion`` is a *cut* of that session.
   The session (up to its last cut, or all of it when old log-probs are wanted)
   is encoded once with ``use_cache=True``; each probe then runs only
   ``1 + len(probe)`` tokens against the cache cropped to the cut: the cut's
   last token is fed again so that the logits predicting the probe's first
   token come from the small pass (the cache is cropped to ``cut - 1``).
3. **Batching.** Sessions are sorted by length and packed into padded batches
   under a token budget (right padding, attention mask); probes of a batch are
   sorted by cut length and run in padded batches whose KV caches are gathered
   from the session caches (left padded so all probes end together, explicit
   position ids so RoPE sees the true positions).
4. **Old log-probs for free.** With ``return_logprobs=True`` every session is
   encoded in full and the same pass yields the log-probs of its completion
   tokens (what PPO needs as the "old" policy), computed from the last hidden
   state in chunks so the ``(L, V)`` logits never exist at once.

:func:`score_reference` re-encodes every state + probe from scratch (slow,
obviously correct; the tests hold the fast path to it within 1e-4).

Limits (say them once): the cache trick needs attention layers whose cache can
be cut at a position (full attention: Llama, Qwen2/3, SmolLM2), and the fused
old-log-prob path applies the output embedding to the decoder's last hidden
state (models with logit soft-capping or scaling would need their own head). Hybrid models
with recurrent / linear-attention layers (e.g. Gated DeltaNet in Qwen3.5) or
sliding windows shorter than the contexts cannot be cropped: use
``method="reference"`` for them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import torch

from mosaic.agent.chat import Probe, ProbeFn
from mosaic.trace.graph import Session, StateRef, Trajectory
from mosaic.trace.rows import turn_boundaries
from mosaic.train.probes import (Host, ScoreStats, eval_mode, extend_cache, run_cached, run_from_caches,
                                 run_reference)

__all__ = ["LiveScorer", "ScoreResult", "TurnScoreResult", "score_gains", "score_reference", "score_turns"]

@dataclass
class ScoreResult:
    """Gains of a batch, aligned with :func:`mosaic.trace.flatten` order (S sessions)."""

    gains: torch.Tensor
    """(S,) float32 ``L(after) - L(before)``; 0 for final sessions."""
    is_final: torch.Tensor
    """(S,) bool; final sessions carry gain 0 and stay out of the statistics."""
    loglik_before: torch.Tensor
    """(S,) float32 ``L(state_before)``; NaN for final sessions."""
    loglik_after: torch.Tensor
    """(S,) float32 ``L(state_after)``; NaN for final sessions."""
    stats: ScoreStats
    old_logprobs: list[torch.Tensor] | None = None
    """Per session (flatten order): (len(completion_ids),) float32 log-probs of the
    completion tokens under the scoring model (at ``temperature``); None unless asked."""


@dataclass
class TurnScoreResult:
    """Turn-level likelihoods (docs/algorithm.md §4.7), one list per session in flatten order."""

    loglik: list[torch.Tensor]
    """Per session: (1 + n_turns,) ``L`` at the prompt and after every turn."""
    gains: list[torch.Tensor]
    """Per session: (n_turns,) ``L(after turn t) - L(before turn t)``."""
    stats: ScoreStats = field(default_factory=ScoreStats)


def probe_for(traj: Trajectory, probe_fn: ProbeFn, cache: dict) -> Probe:
    if traj.ground_truth is None:
        raise ValueError(f"trajectory {traj.id!r}: ground_truth is None; the gain scorer needs the gold answer")
    if traj.ground_truth not in cache:
        ids, (a, b) = probe_fn(traj.ground_truth)
        if not 0 <= a < b <= len(ids):
            raise ValueError(f"probe_fn returned answer span {(a, b)} outside its {len(ids)} tokens")
        cache[traj.ground_truth] = (list(ids), (int(a), int(b)))
    return cache[traj.ground_truth]


def state_host(traj: Trajectory, ref: StateRef) -> tuple[tuple, int]:
    """(host key, cut length) of a state, from its :meth:`~mosaic.trace.Trajectory.state_key`: a session
    prefix (host = the session) or an explicit state (host = the state)."""
    key = traj.state_key(ref)
    if key[0] == "state":
        return key, len(traj.states[key[1]])
    return key[:2], key[2]


def _host_tokens(traj: Trajectory, key: tuple) -> list[int]:
    return list(traj.states[key[1]]) if key[0] == "state" else traj.sessions[key[1]].tokens()


def _plan(trajs: Sequence[Trajectory], probe_fn: ProbeFn, return_logprobs: bool,
          known: Sequence[Mapping[tuple[int, int], float] | None] | None = None):
    """Hosts to encode, and for every session the (host index, cut) of its two states — or
    ``(None, L)`` for a state whose ``L`` is already ``known`` (per trajectory: ``(session id, cut) -> L``)."""
    hosts: list[Host] = []
    host_of: dict[tuple, int] = {}  # (traj, host key) -> index in hosts
    sess_states: list[tuple[tuple[int, int], tuple[int, int]] | None] = []
    sess_logprob_host: list[int] = []
    stats = ScoreStats()
    probes: dict[str, Probe] = {}

    def host(i: int, key: tuple) -> int:
        if (i, key) not in host_of:
            toks = _host_tokens(trajs[i], key)
            host_of[(i, key)] = len(hosts)
            hosts.append(Host(tokens=toks, cuts=[], probe=([], (0, 0))))
        return host_of[(i, key)]

    for i, t in enumerate(trajs):
        for s in t.sessions:
            if return_logprobs:
                h = host(i, ("session", s.id))
                hosts[h].logprob_from = len(s.prompt_ids)
                sess_logprob_host.append(h)
            if s.is_final:
                sess_states.append(None)
                continue
            if s.state_before is None or s.state_after is None:
                raise ValueError(
                    f"trajectory {t.id!r} session {s.id} ({s.kind}): a non-final session needs "
                    "state_before and state_after for the gain scorer"
                )
            pair = []
            for ref in (s.state_before, s.state_after):
                key, cut = state_host(t, ref)
                if cut < 1:
                    raise ValueError(f"trajectory {t.id!r} session {s.id}: empty state {ref} cannot be probed")
                stats.num_state_refs += 1
                have = known[i] if known is not None and known[i] else None
                if have and key[0] == "session" and (key[1], cut) in have:
                    pair.append((None, have[(key[1], cut)]))
                    continue
                h = host(i, key)
                hosts[h].probe = probe_for(t, probe_fn, probes)
                if cut not in hosts[h].cuts:
                    hosts[h].cuts.append(cut)
                pair.append((h, cut))
            sess_states.append((pair[0], pair[1]))
    for h in hosts:
        h.cuts.sort()
        if h.logprob_from is None:  # only the prefix up to the last cut is needed
            h.tokens = h.tokens[: max(h.cuts)]
    stats.num_unique_states = sum(len(h.cuts) for h in hosts)
    return hosts, sess_states, sess_logprob_host, stats


# --------------------------------------------------------------------------------------
# Public entry points.


def _assemble(trajs, hosts, L, sess_states, stats, logprobs, sess_logprob_host) -> ScoreResult:
    S = len(sess_states)
    before = torch.full((S,), float("nan"))
    after = torch.full((S,), float("nan"))
    for k, st in enumerate(sess_states):
        if st is None:
            continue
        (hb, cb), (ha, ca) = st  # (host, cut), or (None, L) for a state scored live
        before[k] = cb if hb is None else L[hb][cb]
        after[k] = ca if ha is None else L[ha][ca]
    final = torch.tensor([st is None for st in sess_states], dtype=torch.bool)
    gains = torch.where(final, torch.zeros(S), after - before).to(torch.float32)
    old = None
    if logprobs is not None and sess_logprob_host:
        old = [logprobs[h] for h in sess_logprob_host]
    return ScoreResult(gains=gains, is_final=final, loglik_before=before, loglik_after=after, stats=stats,
                       old_logprobs=old)  # fmt: skip


def score_gains(
    trajs: Sequence[Trajectory],
    model,
    probe_fn: ProbeFn,
    *,
    method: Literal["cached", "reference"] = "cached",
    return_logprobs: bool = False,
    temperature: float = 1.0,
    max_batch_tokens: int = 16384,
    max_batch_size: int = 64,
    known: Sequence[Mapping[tuple[int, int], float] | None] | None = None,
) -> ScoreResult:
    """Session gains of a batch of trajectories (docs/algorithm.md §4.4).

    Args:
        trajs: T trajectories; every non-final session needs ``state_before`` /
            ``state_after`` and every trajectory with such a session a ``ground_truth``.
        model: HF causal LM (the rollout policy before the update); scored in eval
            mode (the caller's mode is restored). No gradient is taken.
        probe_fn: ``answer -> (suffix_ids, (start, end))`` (e.g. ``ChatFormat.answer_probe``).
        method: ``cached`` (one pass per session, probes off the KV cache) or
            ``reference`` (every state + probe re-encoded from scratch).
        return_logprobs: also return every session's completion log-probs
            (``old_logprobs``) from the same passes (``cached`` only).
        temperature: divides the logits for ``old_logprobs`` (use the sampling
            temperature); ``L`` always uses temperature 1.
        max_batch_tokens / max_batch_size: padded-batch budget.
        known: per trajectory, ``(session id, cut) -> L`` already scored with the same weights (by
            :class:`LiveScorer` during the rollout); those states are not probed again.

    Returns:
        :class:`ScoreResult`, session axis in :func:`mosaic.trace.flatten` order.
    """
    if method not in ("cached", "reference"):
        raise ValueError(f"method must be 'cached' or 'reference', got {method!r}")
    if return_logprobs and method != "cached":
        raise ValueError("return_logprobs needs method='cached'")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    t0 = time.perf_counter()
    if known is not None and len(known) != len(trajs):
        raise ValueError(f"known: {len(known)} entries for {len(trajs)} trajectories")
    hosts, sess_states, sess_lp_host, stats = _plan(trajs, probe_fn, return_logprobs, known)
    logprobs = None
    with eval_mode(model):
        if method == "cached":
            L, logprobs = run_cached(model, hosts, stats, max_batch_tokens=max_batch_tokens,
                                      max_batch_size=max_batch_size, temperature=temperature)  # fmt: skip
        else:
            L = run_reference(model, hosts, stats)
    stats.seconds = time.perf_counter() - t0
    return _assemble(trajs, hosts, L, sess_states, stats, logprobs, sess_lp_host)


class LiveScorer:
    """Session states scored off the rollout policy's live KV cache (docs/algorithm.md §4.4: the rollout policy).

    Every state the scorer needs is a prefix of a main session (its prompt, its end, its subagents' fork
    and merge points), and the policy encoded those tokens while it generated. The harness
    (:class:`~mosaic.agent.harness.Harness` ``state_scorer=``) calls :meth:`session_closed` as each session
    ends, before its cache is released, and :meth:`flush` after every round of turns; the probes of all
    sessions closed in a round then run in one batched pass against their caches — only the probes' few
    tokens each. A main session that ends in a compaction is probed when that compaction ends: the
    compaction's prompt is the main session's whole context, and its cache (taken over from the main
    session, then prefilled by the compaction turn) covers the main session's end, which the main
    session's own cache lacks (the tool response appended after its last turn). A state whose tokens
    are not all cached (a cache evicted, or a session cut right after a merge) gets its tail encoded on
    top of the cache first. :meth:`known` then feeds :func:`score_gains`, which probes only what is missing
    (counted in ``score/live_missed``).

    The policy must expose ``cached_prefix(key)`` (:class:`~mosaic.agent.policies.local.LocalPolicy`);
    its model is the one scored.
    """

    def __init__(self, policy, probe_fn: ProbeFn, *, max_batch_tokens: int = 16384, max_batch_size: int = 64) -> None:
        self.policy = policy
        self.model = policy.model
        self.probe_fn = probe_fn
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.stats = ScoreStats()
        self.values: dict[str, dict[tuple[int, int], float]] = {}
        self.missed = 0
        self._probes: dict[str, Probe] = {}
        self._deferred: dict[str, list[tuple[int, list[int]]]] = {}  # next session key -> [(session id, cuts)]
        self._pending: list[tuple[str, int, Host, list]] = []  # (traj id, session id, host, cache)

    def session_closed(self, traj: Trajectory, session: Session, session_key: str, cuts: list[int], *,
                       next_key: str | None = None) -> None:
        """``session`` of ``traj`` has ended; ``cuts``: lengths of the states that are prefixes of its tokens;
        ``next_key``: the session that takes over its cache (a compaction whose prompt extends it)."""
        todo = [(session.id, list(cuts))] if cuts else []
        todo += self._deferred.pop(session_key, [])
        if not todo or traj.ground_truth is None:
            return
        t0 = time.perf_counter()
        held = self.policy.cached_prefix(session_key)
        tokens = session.tokens()
        if held is not None and tokens[: len(held[0])] != held[0]:
            held = None  # (never expected: the cache always holds a prefix of the session)
        probe = probe_for(traj, self.probe_fn, self._probes)
        for sid, cs in todo:
            host_tokens = traj.sessions[sid].tokens()
            if sid != session.id and tokens[: len(host_tokens)] != host_tokens:
                self.missed += len(cs)  # (the compaction prompt always starts with the main session's tokens)
                continue
            n_cached = 0 if held is None else len(held[0])
            if next_key is not None and sid == session.id and max(cs) - 1 > n_cached:
                self._deferred.setdefault(next_key, []).append((sid, cs))  # its compaction will hold it all
                continue
            if held is None or not held[0]:
                self.missed += len(cs)
                continue
            kv = held[1]
            if max(cs) - 1 > n_cached:  # rare: the tail after the last turn is not cached yet
                kv = extend_cache(self.model, host_tokens, kv, max(cs) - 1, self.stats)
            self._pending.append((traj.id, sid, Host(tokens=host_tokens[: max(cs)], cuts=cs, probe=probe), kv))
        self.stats.seconds += time.perf_counter() - t0

    def flush(self) -> None:
        """Probe every state of the sessions closed since the last flush (one batched pass)."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        with eval_mode(self.model):
            L = run_from_caches(self.model, [h for _, _, h, _ in pending], [kv for *_, kv in pending], self.stats,
                                max_batch_tokens=self.max_batch_tokens, max_batch_size=self.max_batch_size)
        for (tid, sid, _, _), vals in zip(pending, L):
            mine = self.values.setdefault(tid, {})
            for c, v in vals.items():
                mine[(sid, c)] = v
            self.stats.num_unique_states += len(vals)
        self.stats.seconds += time.perf_counter() - t0

    def known(self, trajs: Sequence[Trajectory]) -> list[dict[tuple[int, int], float] | None]:
        """Per trajectory (in ``trajs`` order), the states scored live: ``known=`` of :func:`score_gains`."""
        self.flush()
        self.missed += sum(len(cs) for v in self._deferred.values() for _, cs in v)  # a compaction never closed
        self._deferred.clear()
        return [self.values.get(t.id) for t in trajs]

    def metrics(self) -> dict[str, float]:
        """Its cost and coverage; ``score/probes``, ``score/unique_states`` and ``score/tokens_encoded`` add to
        those of the pass after the rollout."""
        st = self.stats
        return {"timing_s/score_live": st.seconds, "score/live_states": float(st.num_unique_states),
                "score/live_missed": float(self.missed), "score/probes": float(st.num_probes),
                "score/unique_states": float(st.num_unique_states), "score/tokens_encoded": float(st.tokens_encoded)}


def score_reference(trajs: Sequence[Trajectory], model, probe_fn: ProbeFn) -> ScoreResult:
    """Slow reference: every unique state + probe encoded from scratch, one at a time."""
    return score_gains(trajs, model, probe_fn, method="reference")


def score_turns(
    trajs: Sequence[Trajectory],
    model,
    probe_fn: ProbeFn,
    *,
    method: Literal["cached", "reference"] = "reference",
    include_final: bool = True,
    header_ids: Sequence[int] | None = None,
    max_batch_tokens: int = 16384,
    max_batch_size: int = 64,
) -> TurnScoreResult:
    """Turn-level ``L`` (docs/algorithm.md §4.7, IGPO-style): one probe at every session's prompt
    and after every turn. ``method="reference"`` re-encodes each turn's context
    from scratch, as IGPO does; ``cached`` reuses the session's KV cache.
    ``include_final=False`` skips final sessions (their gains are unused);
    ``header_ids``: see :func:`turn_boundaries`."""
    t0 = time.perf_counter()
    stats = ScoreStats()
    probes: dict[str, Probe] = {}
    hosts: list[Host] = []
    where: list[int | None] = []
    for t in trajs:
        for s in t.sessions:
            if s.is_final and not include_final:
                where.append(None)
                continue
            cuts = sorted(set(c for c in turn_boundaries(s, header_ids) if c >= 1))
            hosts.append(Host(tokens=s.tokens()[: max(cuts)], cuts=cuts, probe=probe_for(t, probe_fn, probes)))
            where.append(len(hosts) - 1)
    stats.num_unique_states = stats.num_state_refs = sum(len(h.cuts) for h in hosts)
    if method not in ("cached", "reference"):
        raise ValueError(f"method must be 'cached' or 'reference', got {method!r}")
    with eval_mode(model):
        if method == "cached":
            L, _ = run_cached(model, hosts, stats, max_batch_tokens=max_batch_tokens,
                               max_batch_size=max_batch_size, temperature=1.0)  # fmt: skip
        else:
            L = run_reference(model, hosts, stats)
    lls, gains = [], []
    for w in where:
        if w is None:
            lls.append(torch.zeros(0))
            gains.append(torch.zeros(0))
            continue
        v = torch.tensor([L[w][c] for c in hosts[w].cuts])
        lls.append(v)
        gains.append(v[1:] - v[:-1])
    stats.seconds = time.perf_counter() - t0
    return TurnScoreResult(loglik=lls, gains=gains, stats=stats)
