"""The trainer's one path from trajectories to advantages and training rows.

``rl_step`` calls :func:`score_for` (the gains the configured estimator asks for,
scored with the rollout policy), :func:`compute_advantages` (the estimator from
``mosaic.core.estimators`` on an :class:`AdvantageBatch` built here) and
:func:`training_rows` (one row per session, with per-token advantages for turn-level
estimators). What an estimator needs is read from its registry entry
(``Estimator.needs``, ``Estimator.level``), never from a copy of its name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from mosaic.core.estimators import ESTIMATORS, AdvantageBatch, Estimator, EstimatorParams, get_estimator
from mosaic.trace.graph import KIND_CODES, Trajectory, kind_names
from mosaic.trace.rows import TrainingRow, TurnLayout, flatten, to_rows, turn_layout, turn_spans
from mosaic.config.loader import AlgoConfig, Config
from mosaic.train.downstream import group_references, score_downstream, with_references
from mosaic.train.scorer import score_gains, score_turns

__all__ = ["Scores", "StepAdvantages", "drop_uniform_groups", "estimator_params", "advantage_batch", "step_advantages",
           "half_budgets", "compute_advantages", "every_estimator", "training_rows", "score_for"]


@dataclass
class Scores:
    """Information gains of a batch, as the estimator asked for them (None where not scored)."""

    gains: torch.Tensor | None = None
    """(S,) session gains in flatten order."""
    is_final: torch.Tensor | None = None
    """(S,) final flags of the scored sessions."""
    turn_gains: torch.Tensor | None = None
    """(U,) turn gains in :func:`~mosaic.trace.turn_layout` order."""
    downstream: torch.Tensor | None = None
    """(S,) downstream credit (docs/algorithm.md §4.10) in flatten order."""
    downstream_how: list[str] | None = None
    """(S,) how each downstream credit was obtained (``direct``, ``propagated``, ...)."""
    gain_valid: torch.Tensor | None = None
    """(S,) False where the session's trajectory had no answer to probe (``algo.gain_reference=group`` and no
    success in its group); None: every session had one."""
    metrics: dict[str, float] | None = None

    def unscored(self) -> torch.Tensor | None:
        """(S,) the sessions left out of the gain statistics (finals, and those without a reference)."""
        if self.is_final is None:
            return None
        return self.is_final if self.gain_valid is None else self.is_final | ~self.gain_valid


def drop_uniform_groups(trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
    """The trajectories of groups whose rewards are not all equal, and the number of groups dropped."""
    rewards: dict[str, set[float]] = {}
    for t in trajs:
        rewards.setdefault(t.group_id, set()).add(float(t.reward))
    mixed = {g for g, r in rewards.items() if len(r) > 1}
    return [t for t in trajs if t.group_id in mixed], len(rewards) - len(mixed)


def estimator_params(algo: AlgoConfig) -> EstimatorParams:
    """The estimator knobs of ``algo`` (one field per knob of the registry)."""
    return EstimatorParams(**algo.knobs())


def half_budgets(harness) -> dict[str, int]:
    """The context budgets ``fold``'s half-budget flags read (docs/algorithm.md §4.8): a main session's, and in
    reset mode a reset session's (the agent's own line of work; summaries and helpers are not flagged)."""
    return {"main": harness.context_budget, "reset": harness.budget("reset")}


def advantage_batch(trajs: Sequence[Trajectory], gains=None, *, count_kinds: Sequence[str] | None = None,
                    layout: TurnLayout | None = None, turn_gains=None,
                    context_budget: int | Mapping[str, int] | None = None, downstream=None,
                    gain_valid=None) -> AdvantageBatch:  # fmt: skip
    """An :class:`AdvantageBatch` from trajectories; ``gains``, ``downstream`` (float), ``gain_valid`` (bool):
    (S,) in flatten order or None; ``layout`` (+ ``turn_gains`` (U,), ``context_budget`` for the half-budget
    flags) for turn-level fields. ``context_budget``: the budget of ``main`` sessions, or ``{kind: budget}``
    for the kinds whose turns the flags cover (the agent's own line of work: ``main``, and ``reset`` in reset
    mode, whose sessions have their own budget)."""
    fb = flatten(trajs, count_kinds=count_kinds)

    def per_session(name: str, values, dtype):
        if values is None:
            return None
        v = torch.as_tensor(values, dtype=dtype)
        if v.shape != (len(fb.kinds),):
            raise ValueError(f"{name} has shape {tuple(v.shape)}, expected ({len(fb.kinds)},) sessions in flatten order")
        return v

    g = per_session("gains", gains, torch.float32)
    turns: dict[str, torch.Tensor | None] = {}
    if layout is not None:
        turns["turn_session"] = torch.from_numpy(layout.session)
        turns["turn_is_final"] = torch.from_numpy(layout.is_final)
        if turn_gains is not None:
            turns["turn_gains"] = torch.as_tensor(turn_gains, dtype=torch.float32)
        if context_budget is not None:
            budgets = dict(context_budget) if isinstance(context_budget, Mapping) else {"main": context_budget}
            kinds = fb.kinds[layout.session]
            over = np.zeros(len(layout.session), dtype=bool)
            for kind, cap in budgets.items():
                over |= (kinds == KIND_CODES[kind]) & (layout.context > cap / 2)
            turns["turn_over_half"] = torch.from_numpy(over)
    return AdvantageBatch(
        rewards=torch.from_numpy(fb.rewards), group_ids=torch.from_numpy(fb.group_ids),
        session_counts=torch.from_numpy(fb.session_counts), success=torch.from_numpy(fb.success),
        session_traj=torch.from_numpy(fb.session_traj), kinds=torch.from_numpy(fb.kinds),
        is_final=torch.from_numpy(fb.is_final), gains=g, downstream=per_session("downstream", downstream, torch.float32),
        gain_valid=per_session("gain_valid", gain_valid, torch.bool), **turns,
    )  # fmt: skip


@dataclass
class StepAdvantages:
    """A step's advantages, each estimator run once: the trained one's and, for ``samples.jsonl``, every other's."""

    advantages: torch.Tensor
    """(S,) or (U,) of the trained estimator (``Estimator.level``)."""
    metrics: dict[str, float]
    """The trained estimator's metrics."""
    layout: TurnLayout | None
    """The turn layout the advantages were computed on (None when nothing needed turns)."""
    every: dict[str, torch.Tensor] = field(default_factory=dict)
    """``every=True``: each registered estimator's advantages on this batch (the trained one's is the same tensor)."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """``every=True``: why an estimator is missing from ``every`` (inputs not scored, batch refused)."""


def step_advantages(trajs: Sequence[Trajectory], cfg: Config, scores: Scores | None = None, *,
                    layout: TurnLayout | None = None, every: bool = False) -> StepAdvantages:  # fmt: skip
    """Advantages with ``cfg.algo.estimator`` and its metrics; with ``every``, also every other registered
    estimator on the same batch and knobs (for ``samples.jsonl``): one batch, one params object, each
    estimator run once. ``layout`` is built here when an estimator needs turns and none is given."""
    est = get_estimator(cfg.algo.estimator)
    scores = scores or Scores()
    if est.needs_gains and scores.gains is None:
        raise ValueError(f"algo.estimator={est.name!r} needs information gains: score the batch first")
    if "turn_gains" in est.needs and scores.turn_gains is None:
        raise ValueError(f"algo.estimator={est.name!r} needs turn-level gains: score the turns first")
    if "downstream" in est.needs and scores.downstream is None:
        raise ValueError(f"algo.estimator={est.name!r} needs downstream credit: score the batch first")
    turns = every or est.needs_turns
    if turns and layout is None:
        layout = turn_layout(trajs)
    budget = every or "turn_over_half" in est.needs
    batch = advantage_batch(trajs, scores.gains if every or est.needs_gains else None, count_kinds=cfg.algo.count_kinds,
                            layout=layout if turns else None, turn_gains=scores.turn_gains,
                            context_budget=half_budgets(cfg.harness) if budget else None,
                            downstream=scores.downstream if every or "downstream" in est.needs else None,
                            gain_valid=scores.gain_valid)  # fmt: skip
    params = estimator_params(cfg.algo)
    adv, metrics = est(batch, params, kind_names=kind_names())
    out = StepAdvantages(adv, metrics, layout if turns else None)
    if every:
        out.every, out.unavailable = every_estimator(batch, params, known={est.name: adv})
    return out


def every_estimator(batch: AdvantageBatch, params: EstimatorParams, *, known: dict[str, torch.Tensor] | None = None,
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:  # fmt: skip
    """Every registered estimator on ``batch``, in registry order: ``({name: advantages}, {name: why not})``;
    ``known`` ones are taken as given, not run again. An estimator whose inputs are missing, or that refuses
    the batch (``grpo`` on multi-session rollouts), is listed with the reason instead."""
    out: dict[str, torch.Tensor] = {}
    why: dict[str, str] = {}
    for name, e in ESTIMATORS.items():
        if known and name in known:
            out[name] = known[name]
            continue
        missing = sorted(n for n in e.needs if getattr(batch, n) is None)
        if missing:
            why[name] = f"needs {', '.join(missing)} (not recorded for this step)"
            continue
        try:
            out[name], _ = e(batch, params)
        except ValueError as exc:  # e.g. grpo on a multi-session batch
            why[name] = str(exc)
    return out, why


def compute_advantages(trajs: Sequence[Trajectory], cfg: Config, scores: Scores | None = None, *,
                       layout: TurnLayout | None = None) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """Advantages with ``cfg.algo.estimator`` — (S,) per session or (U,) per turn (``Estimator.level``) —
    and the estimator's metrics (:func:`step_advantages` without the other estimators)."""
    res = step_advantages(trajs, cfg, scores, layout=layout)
    return res.advantages, res.metrics


def training_rows(trajs: Sequence[Trajectory], adv: torch.Tensor, est: Estimator,
                  layout: TurnLayout | None = None) -> list[TrainingRow]:  # fmt: skip
    """One row per session with its advantage; a turn-level estimator's (U,) advantages are spread over
    each turn's completion tokens (``TrainingRow.token_advantages``)."""
    if est.level == "session":
        return to_rows(trajs, adv.tolist())
    layout = layout if layout is not None else turn_layout(trajs)
    rows = to_rows(trajs)
    if adv.shape != (len(layout.session),):
        raise ValueError(f"turn advantages have shape {tuple(adv.shape)}, expected ({len(layout.session)},) turns")
    own = [r for r in rows if r.stretch is None]  # (S,) the sessions' rows, in flatten order
    per_row = [np.zeros(len(r.completion_ids), dtype=np.float64) for r in own]
    for u, (k, a, b) in enumerate(zip(layout.session, layout.start, layout.end)):
        per_row[k][a:b] = float(adv[u])
    for r, v in zip(own, per_row):
        r.token_advantages = v.tolist()
        trained = v[np.asarray(r.loss_mask, dtype=bool)]
        r.advantage = float(trained.mean()) if trained.size else 0.0  # for reading; the loss uses the tokens'
    session_row = None
    for r in rows:  # a detached stretch has no turns of its own: its session's mean advantage on every token
        if r.stretch is None:
            session_row = r
        else:
            r.advantage = session_row.advantage
            r.token_advantages = [r.advantage] * len(r.completion_ids)
    return rows


def score_for(est: Estimator, trajs: Sequence[Trajectory], model, chat, algo: AlgoConfig, *,
              known: Sequence | None = None, refs: dict[str, str | None] | None = None) -> Scores:
    """Score what ``est`` needs with ``model`` (the rollout policy, before the update; docs/algorithm.md §4.4, §4.7,
    §4.10); ``known``: states already scored live (:class:`~mosaic.train.scorer.LiveScorer`); ``refs``: with
    ``algo.gain_reference=group``, the groups' references when ``trajs`` is part of a larger batch (a rank's
    share: :func:`~mosaic.train.downstream.group_references` of the whole batch); None: from ``trajs``."""
    out = Scores(metrics={})
    scored = list(trajs)
    if algo.gain_reference == "group" and (est.needs_gains or "turn_gains" in est.needs):
        refs = group_references(trajs) if refs is None else refs
        scored = with_references(trajs, refs)  # (no answer is known to a live scorer: known is None here)
        out.gain_valid = torch.tensor([t.ground_truth is not None for t in scored for _ in t.sessions], dtype=torch.bool)
        out.metrics["score/groups_without_reference"] = float(sum(r is None for r in refs.values()))
        if known is not None:
            raise ValueError("algo.gain_reference=group cannot use states scored live (algo.score_live=false)")
    if est.needs_gains:
        out.gains, out.is_final = _session_gains(scored, model, chat, algo, known, out.metrics)
    if "downstream" in est.needs:
        res = score_downstream(scored, model, chat.answer_probe, out.gains, empty_result_ids=chat.tool_delta(""),
                               header_ids=chat.generation_header_ids, method=algo.scorer,
                               max_batch_tokens=algo.score_batch_tokens)  # fmt: skip
        out.downstream, out.downstream_how = res.downstream, res.how
        out.metrics.update(res.metrics)
    if "turn_gains" in est.needs:
        res = score_turns(scored, model, chat.answer_probe, method=algo.scorer, header_ids=chat.generation_header_ids,
                          max_batch_tokens=algo.score_batch_tokens)  # fmt: skip
        per_session = [len(turn_spans(s.loss_mask)) for t in trajs for s in t.sessions]
        got = [int(g.numel()) for g in res.gains]
        if got != per_session:
            raise RuntimeError(f"turn scorer returned {sum(got)} turn gains for {sum(per_session)} turns")
        out.turn_gains = torch.cat([g.to(torch.float32) for g in res.gains]) if res.gains else torch.zeros(0)
        out.metrics.update(res.stats.as_metrics())
    return out


def _session_gains(trajs: Sequence[Trajectory], model, chat, algo: AlgoConfig, known, metrics: dict) -> tuple:
    """(gains (S,), is_final (S,)) of ``trajs``; trajectories without an answer to probe (None) are not scored
    (gain 0: :attr:`Scores.gain_valid` keeps them out of the statistics)."""
    have = [i for i, t in enumerate(trajs) if t.ground_truth is not None]
    if len(have) == len(trajs):
        res = score_gains(trajs, model, chat.answer_probe, method=algo.scorer, max_batch_tokens=algo.score_batch_tokens,
                          known=known)  # fmt: skip
        metrics.update(res.stats.as_metrics())
        return res.gains, res.is_final
    sub = [trajs[i] for i in have]
    res = score_gains(sub, model, chat.answer_probe, method=algo.scorer, max_batch_tokens=algo.score_batch_tokens,
                      known=None if known is None else [known[i] for i in have]) if sub else None  # fmt: skip
    if res is not None:
        metrics.update(res.stats.as_metrics())
    gains, final = [], []
    k = 0
    have_set = set(have)
    for i, t in enumerate(trajs):
        for s in t.sessions:
            final.append(bool(s.is_final))
            if i in have_set:
                gains.append(float(res.gains[k]))
                k += 1
            else:
                gains.append(0.0)
    return torch.tensor(gains, dtype=torch.float32), torch.tensor(final, dtype=torch.bool)
