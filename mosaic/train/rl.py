"""One RL step of ``mosaic train``: rollouts → rewards → gains → advantages → PPO update.

The step knows the algorithm only through names: the estimator comes from
``mosaic.core.estimators`` by ``algo.estimator``, the loss is
``mosaic.core.loss.policy_loss`` with whole-batch weights from
``token_weights``. Each session is one training row (SPEC §5).

Simplifications (said once): the PPO ratio uses the sampling log-probs the
rollout policy recorded (no recompute pass: rollouts and update run the same
fp32 weights in one process, so they are the old policy's log-probs); the
information gain is scored with the rollout policy before the update, as
SPEC §4.4 asks.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mosaic.agent.chat import ChatFormat
from mosaic.agent.harness import DeepSearchEnv, Harness
from mosaic.core.estimators import get_estimator
from mosaic.core.loss import policy_loss, token_weights
from mosaic.envs.splits import Split
from mosaic.trace import Trajectory, turn_layout
from mosaic.train.agreement import Agreement, warn_if_low
from mosaic.train.batch import (Scores, compute_advantages, drop_uniform_groups, estimator_params, score_for,
                                training_rows)
from mosaic.train.batching import collate, completion_logprobs, micro_batches, pack_rows
from mosaic.train.config import Config
from mosaic.train.metrics import rollout_metrics
from mosaic.train.samples import all_estimator_advantages, sample_records
from mosaic.train.scorer import LiveScorer
from mosaic.train.setup import sampling_policy


@dataclass
class RLState:
    """What one step needs besides the config; built once per run."""

    cfg: Config
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    chat: ChatFormat
    split: Split
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    ref_model: PreTrainedModel | None = None
    last_trajs: list[Trajectory] = field(default_factory=list)
    last_samples: list[dict] = field(default_factory=list)
    """The ``samples.jsonl`` lines of the last step (``train.rollout_samples`` of its trajectories)."""
    source: Any = None
    """Where rollouts come from when not the built-in harness (``rollout.source``): an object with
    ``collect(tasks, step) -> (trajectories, metrics)`` and ``hold()`` (a context manager the scoring and
    the update run in: :class:`mosaic.train.external.ExternalRollouts`)."""


def task_order(n_tasks: int, seed: int, epoch: int) -> list[int]:
    """The training-task permutation of an epoch (deterministic: resume needs only the step)."""
    order = list(range(n_tasks))
    random.Random(f"{seed}/epoch/{epoch}").shuffle(order)
    return order


def tasks_for_step(split, step: int, batch_tasks: int, seed: int) -> list:
    """B tasks for step ``step`` (0-based): consecutive slices of per-epoch permutations."""
    n = len(split.tasks)
    out = []
    for k in range(step * batch_tasks, (step + 1) * batch_tasks):
        epoch, pos = divmod(k, n)
        out.append(split.tasks[task_order(n, seed, epoch)[pos]])
    # A task drawn twice in one batch (tiny splits) would merge two groups; keep the first.
    seen, uniq = set(), []
    for t in out:
        if t.id not in seen:
            seen.add(t.id)
            uniq.append(t)
    return uniq


def make_reference(model: PreTrainedModel) -> PreTrainedModel:
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def rollout(st: RLState, tasks: Sequence, step: int) -> list[Trajectory]:
    """The step's trajectories (B tasks x G samples through the built-in harness)."""
    return _rollout(st, tasks, step, live=False)[0]


def rollout_scored(st: RLState, tasks: Sequence, step: int) -> tuple[list[Trajectory], LiveScorer]:
    """:func:`rollout`, with the session states scored off the rollout policy's cache as sessions close."""
    trajs, live = _rollout(st, tasks, step, live=True)
    assert live is not None
    return trajs, live


def _rollout(st: RLState, tasks: Sequence, step: int, *, live: bool) -> tuple[list[Trajectory], LiveScorer | None]:
    cfg = st.cfg
    policy = sampling_policy(cfg, st.model, st.tokenizer, seed=cfg.train.seed * 1_000_003 + step)
    scorer = LiveScorer(policy, st.chat.answer_probe, max_batch_tokens=cfg.algo.score_batch_tokens) if live else None
    harness = Harness(policy, st.chat, DeepSearchEnv(st.split), cfg.harness, state_scorer=scorer)
    return harness.run(tasks, group_size=cfg.train.group_size, seed=cfg.train.seed + step, step=step), scorer


def _accumulate_gradients(st: RLState, packed, w_rows: torch.Tensor, *, temperature: float,
                          agree: Agreement | None = None) -> dict[str, float]:
    """Backward the loss of every micro-batch of ``packed`` (weights from the whole mini-batch) and
    combine their metrics: weighted ones add up, extrema combine. ``agree``: fed the trainer's and the
    sampler's log-probs of the trained tokens (before any update of this step)."""
    cfg = st.cfg
    out: dict[str, float] = {}
    for micro in micro_batches(packed, range(len(packed)), cfg.optim.micro_batch_size):
        batch = collate(packed, micro, pad_id=st.tokenizer.pad_token_id).to(st.device)
        lp, ent = completion_logprobs(st.model, batch, temperature=temperature, with_entropy=True)
        if agree is not None:
            agree.add(lp, batch.old_logprobs, batch.loss_mask)
        ref_lp = None
        if st.ref_model is not None and cfg.algo.kl_coef > 0:
            with torch.no_grad():
                ref_lp, _ = completion_logprobs(st.ref_model, batch, temperature=temperature)
        w = batch.token_weights(w_rows)  # (R, Lc): each token carries its session's weight
        res = policy_loss(lp, batch.old_logprobs, batch.advantages, batch.loss_mask, w,
                          clip_low=cfg.algo.clip_low, clip_high=cfg.algo.clip_high,
                          clip_ratio_c=cfg.algo.clip_ratio_c, ref_logprobs=ref_lp,
                          kl_coef=cfg.algo.kl_coef, entropy=ent)  # fmt: skip
        res.loss.backward()
        for k, v in res.metrics.items():
            if k.endswith("_max"):
                out[k] = max(out.get(k, v), v)
            elif k.endswith("_min"):
                out[k] = min(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0.0) + v
    return out


def update(st: RLState, rows, *, temperature: float) -> dict[str, float]:
    """PPO epochs × mini-batches (split by trajectory) × micro-batches; returns averaged metrics."""
    cfg = st.cfg
    o = cfg.optim
    model = st.model
    model.train()
    traj_ids = sorted({r.traj_index for r in rows})
    sums: dict[str, float] = {}
    n_updates = 0
    # measured on the first mini-batch, before its optimizer step (every trained token with mini_batches=1)
    agree: Agreement | None = Agreement()
    agreement: dict[str, float] = {}
    rng = random.Random(cfg.train.seed)
    for _epoch in range(o.ppo_epochs):
        order = list(traj_ids)
        rng.shuffle(order)
        per = max(1, -(-len(order) // o.mini_batches))
        for mb in range(0, len(order), per):
            keep = set(order[mb : mb + per])
            idx = [i for i, r in enumerate(rows) if r.traj_index in keep]
            # Normalisers from the whole mini-batch, so the micro-batch size never changes the update.
            w_rows = torch.zeros(len(rows), dtype=torch.float32)
            w_rows[idx] = token_weights([rows[i].num_trainable for i in idx], [rows[i].traj_index for i in idx],
                                        mode=cfg.algo.loss_agg)
            # Sessions whose ids prefix another session's (main → its compaction) train in one pass.
            packed = pack_rows(rows, idx)
            st.optimizer.zero_grad(set_to_none=True)
            mb_metrics = _accumulate_gradients(st, packed, w_rows, temperature=temperature, agree=agree)
            if agree is not None:
                agreement = agree.metrics(cfg.rollout.agreement_warn_corr)
                agree = None
            clip = o.grad_clip if o.grad_clip > 0 else float("inf")
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            mb_metrics["actor/grad_norm"] = float(gn)
            if torch.isfinite(gn):
                st.optimizer.step()
            else:  # a non-finite gradient would poison the weights: skip and count it
                mb_metrics["actor/skipped_updates"] = 1.0
            st.scheduler.step()
            n_updates += 1
            for k, v in mb_metrics.items():
                sums[k] = sums.get(k, 0.0) + v
    model.eval()
    out = {k: v / max(1, n_updates) for k, v in sums.items()}
    out["actor/lr"] = float(st.scheduler.get_last_lr()[0])
    out["actor/updates"] = float(n_updates)
    out.update(agreement)
    warn_if_low(agreement, cfg.rollout.agreement_warn_corr)
    return out


def _samples(cfg: Config, trajs: list[Trajectory], scores, layout, step: int) -> list[dict]:
    """The first ``train.rollout_samples`` trajectories as ``samples.jsonl`` lines, with the advantage every
    estimator gives them on this batch (cheap: no model call; gains only where the step scored them)."""
    layout = layout if layout is not None else turn_layout(trajs)
    advs, why = all_estimator_advantages(trajs, estimator_params(cfg.algo), gains=scores.gains,
                                         turn_gains=scores.turn_gains, layout=layout,
                                         context_budget=cfg.harness.context_budget,
                                         count_kinds=cfg.algo.count_kinds)  # fmt: skip
    keep = range(min(cfg.train.rollout_samples, len(trajs)))
    return sample_records(trajs, keep, step=step, estimator=cfg.algo.estimator, advantages=advs, unavailable=why,
                          gains=scores.gains, turn_gains=scores.turn_gains, layout=layout)  # fmt: skip


_ADDITIVE = frozenset({"score/probes", "score/unique_states", "score/tokens_encoded"})


def rl_step(st: RLState, step: int) -> dict[str, float]:
    """Run training step ``step`` (0-based) and return its metrics."""
    cfg = st.cfg
    est = get_estimator(cfg.algo.estimator)
    t0 = time.perf_counter()
    tasks = tasks_for_step(st.split, step, cfg.train.batch_tasks, cfg.train.seed)
    source_metrics: dict[str, float] = {}
    live = None
    if st.source is None:
        if est.needs_gains and cfg.algo.scorer == "cached" and cfg.algo.score_live:
            trajs, live = rollout_scored(st, tasks, step)
            live.flush()  # (the harness flushes after every round: normally nothing is left)
        else:
            trajs = rollout(st, tasks, step)
    else:
        trajs, source_metrics = st.source.collect(tasks, step)
    st.last_trajs = trajs
    t_gen = time.perf_counter() - t0

    # An external source's served weights are held from here to the end of the update: no request is
    # answered by weights being changed, and the version it stamps goes up once they have changed.
    with st.source.hold() if st.source is not None else contextlib.nullcontext():
        train, skipped = drop_uniform_groups(trajs) if cfg.algo.skip_uniform_groups else (list(trajs), 0)
        t1 = time.perf_counter()
        known = live.known(train) if live is not None else None
        scores = score_for(est, train, st.model, st.chat, cfg.algo, known=known) if train else Scores(metrics={})
        t_score = time.perf_counter() - t1
        if live is not None:  # probes run during the rollout count as scoring, not generation
            t_gen -= live.stats.seconds
            t_score += live.stats.seconds
            for k, v in live.metrics().items():  # probe counts: both passes together
                scores.metrics[k] = scores.metrics.get(k, 0.0) + v if k in _ADDITIVE else v

        rows, adv_metrics, upd = [], {}, {}
        st.last_samples = []
        if train:  # every group uniform and skipped (or every rollout dropped): nothing to learn from
            layout = turn_layout(train) if est.needs_turns else None
            adv, adv_metrics = compute_advantages(train, cfg, scores, layout=layout)
            rows = training_rows(train, adv, est, layout)
            st.last_samples = _samples(cfg, train, scores, layout, step + 1) if cfg.train.rollout_samples else []
        t2 = time.perf_counter()
        if rows:
            upd = update(st, rows, temperature=cfg.rollout.temperature)
        t_update = time.perf_counter() - t2

    total = time.perf_counter() - t0
    tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    m = rollout_metrics(train, None if scores.gains is None else scores.gains.numpy(),
                        None if scores.is_final is None else scores.is_final.numpy()) if train \
        else rollout_metrics(trajs, None, None)  # fmt: skip
    if cfg.algo.skip_uniform_groups:  # rewards of the whole batch, not only of the groups trained on
        m.update({k: v for k, v in rollout_metrics(trajs, None, None).items() if k.startswith("critic/")})
        m["train/groups_skipped"] = float(skipped)
    m.update(adv_metrics)
    m.update(scores.metrics or {})
    m.update(upd)
    m.update({"timing_s/gen": t_gen, "timing_s/score": t_score, "timing_s/update_actor": t_update,
              "timing_s/step": total, "perf/throughput": tokens / max(total, 1e-9),
              "train/tasks": float(len(tasks)), "train/sessions": float(len(rows))})  # fmt: skip
    m.update(source_metrics)  # (a replay source says how many tasks it trained on)
    return m
