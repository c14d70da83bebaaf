"""One RL step of ``mosaic train``: rollouts → rewards → gains → advantages → PPO update.

The step knows the algorithm only through names: the estimator comes from
``mosaic.core.estimators`` by ``algo.estimator``, the loss is
``mosaic.core.loss.policy_loss`` with whole-batch weights from
``token_weights``. Each session is one training row (docs/algorithm.md §5).

Simplifications (said once): the PPO ratio uses the sampling log-probs the
rollout policy recorded (no recompute pass: rollouts and update run the same
fp32 weights in one process, so they are the old policy's log-probs); the
information gain is scored with the rollout policy before the update, as
docs/algorithm.md §4.4 asks.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mosaic.agent.chat import ChatFormat
from mosaic.core.estimators import get_estimator
from mosaic.core.loss import policy_loss, token_weights
from mosaic.envs.splits import Split
from mosaic.trace import Trajectory
from mosaic.train.batch import Scores, StepAdvantages, drop_uniform_groups, score_for, step_advantages, training_rows
from mosaic.train import capo
from mosaic.train.agreement import Agreement, warn_if_low
from mosaic.train.batching import collate, completion_logprobs, micro_batches, pack_rows, plain_head
from mosaic.train.prefix_tree import tree_logprobs
from mosaic.config.loader import Config
from mosaic.train.metrics import rollout_metrics
from mosaic.train.samples import sample_records
from mosaic.train.served_scoring import known_from_cache
from mosaic.train.setup import frozen_copy
from mosaic.train.sources import HarnessRollouts, RolloutSource


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
    """The frozen KL reference (``algo.kl_coef > 0``); None there = a frozen copy of ``model`` as given,
    made at construction (a resumed run passes the warm start instead)."""
    last_trajs: list[Trajectory] = field(default_factory=list)
    last_samples: list[dict] = field(default_factory=list)
    """The ``samples.jsonl`` lines of the last step (``train.rollout_samples`` of its trajectories)."""
    source: RolloutSource | None = None
    """Where rollouts come from (``rollout.source``, :mod:`mosaic.train.sources`); None = the built-in
    harness on ``model`` (:class:`~mosaic.train.sources.HarnessRollouts`), made at construction."""

    def __post_init__(self) -> None:
        if self.source is None:
            self.source = HarnessRollouts(self.cfg, self.model, self.tokenizer, self.chat, self.split)
        if self.ref_model is None and self.cfg.algo.kl_coef > 0:
            self.ref_model = make_reference(self.model)
        self.piece = capo.piece_fn(self.tokenizer)  # (a token's text on its own: CAPO's token types)


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


make_reference = frozen_copy
"""The KL anchor's reference: a frozen copy of the model (:func:`mosaic.train.setup.frozen_copy`)."""


def rollout(st: RLState, tasks: Sequence, step: int) -> list[Trajectory]:
    """The step's trajectories from the run's rollout source."""
    return st.source.collect(tasks, step)[0]


def _accumulate_gradients(st: RLState, packed, w_rows: torch.Tensor, *, temperature: float,
                          agree: Agreement | None = None) -> dict[str, float]:
    """Backward the loss of every micro-batch of ``packed`` (weights from the whole mini-batch) and
    combine their metrics: weighted ones add up, extrema combine. ``agree``: fed the trainer's and the
    sampler's log-probs of the trained tokens (before any update of this step)."""
    cfg = st.cfg
    out: dict[str, float] = {}
    # Shared prefixes run once (prefix_tree): same log-probs and gradient; CAPO's meter needs padded positions.
    tree = cfg.optim.shared_prefix and not cfg.algo.capo and plain_head(st.model) is not None

    def logprobs(model, micro, batch, **kw):
        if tree:
            return tree_logprobs(model, [packed[i] for i in micro], temperature=temperature,
                                 max_batch_tokens=cfg.algo.score_batch_tokens, **kw)  # fmt: skip
        return completion_logprobs(model, batch, temperature=temperature, **kw)

    for micro in micro_batches(packed, range(len(packed)), cfg.optim.micro_batch_size, by_prefix=tree):
        batch = collate(packed, micro, pad_id=st.tokenizer.pad_token_id).to(st.device)
        meter = None
        if cfg.algo.capo:  # §5.1: token types, and the units each activates more (this forward's activations)
            act, meter = capo.meter_for(st.model, batch, st.piece)
        with meter if meter is not None else contextlib.nullcontext():
            lp, ent = logprobs(st.model, micro, batch, with_entropy=True)
        if agree is not None:
            agree.add(lp, batch.old_logprobs, batch.loss_mask)
        ref_lp = None
        if st.ref_model is not None and cfg.algo.kl_coef > 0:
            with torch.no_grad():
                ref_lp, _ = logprobs(st.ref_model, micro, batch)
        w = batch.token_weights(w_rows)  # (R, Lc): each token carries its session's weight
        kw = dict(clip_low=cfg.algo.clip_low, clip_high=cfg.algo.clip_high, clip_ratio_c=cfg.algo.clip_ratio_c,
                  ref_logprobs=ref_lp, kl_coef=cfg.algo.kl_coef)
        res = policy_loss(lp, batch.old_logprobs, batch.advantages, batch.loss_mask, w, entropy=ent, **kw)
        if meter is None:
            res.loss.backward()
        else:  # the loss is linear in the token weights: L = L(action tokens) + L(argument tokens)
            la = policy_loss(lp, batch.old_logprobs, batch.advantages, batch.loss_mask, w * act, **kw).loss
            lb = policy_loss(lp, batch.old_logprobs, batch.advantages, batch.loss_mask, w * ~act, **kw).loss
            res.metrics.update(capo.routed_backward(st.model, la, lb, meter.partitions()))
            res.metrics.update({"capo/action_tokens": float(act.sum()), "capo/trained_tokens": float(batch.loss_mask.sum())})
        for k, v in res.metrics.items():
            if k.endswith("_max"):
                out[k] = max(out.get(k, v), v)
            elif k.endswith("_min"):
                out[k] = min(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0.0) + v
    return capo.share_metrics(out) if cfg.algo.capo else out


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


def _samples(cfg: Config, trajs: list[Trajectory], scores, res: StepAdvantages, step: int) -> list[dict]:
    """The first ``train.rollout_samples`` trajectories as ``samples.jsonl`` lines, with the advantage every
    estimator gives them on this batch, as :func:`step_advantages` computed them (the trained one's are
    the trained values; gains only where the step scored them)."""
    keep = range(min(cfg.train.rollout_samples, len(trajs)))
    return sample_records(trajs, keep, step=step, estimator=cfg.algo.estimator, advantages=res.every,
                          unavailable=res.unavailable, gains=scores.gains, turn_gains=scores.turn_gains,
                          layout=res.layout, downstream=scores.downstream,
                          downstream_how=scores.downstream_how, gain_valid=scores.gain_valid)  # fmt: skip


_ADDITIVE = frozenset({"score/probes", "score/unique_states", "score/tokens_encoded"})


def _scores_from_cache(source, est, algo) -> bool:
    """States of a served policy's rollouts are probed off its prefix cache after the rollouts (what the
    built-in harness's live scorer does during them): the cached scorer, live scoring on, true answers."""
    return (getattr(source, "scoring_policy", None) is not None and est.needs_gains and algo.scorer == "cached"
            and algo.score_live and algo.gain_reference == "answer")


def rl_step(st: RLState, step: int) -> dict[str, float]:
    """Run training step ``step`` (0-based) and return its metrics."""
    cfg = st.cfg
    est = get_estimator(cfg.algo.estimator)
    t0 = time.perf_counter()
    tasks = tasks_for_step(st.split, step, cfg.train.batch_tasks, cfg.train.seed)
    trajs, source_metrics = st.source.collect(tasks, step)
    live = st.source.live_scorer
    st.last_trajs = trajs
    t_gen = time.perf_counter() - t0

    # A served policy's weights are held from here to the end of the update: no request is answered
    # by weights being changed, and the version it stamps goes up once they have changed.
    with st.source.hold():
        train, skipped = drop_uniform_groups(trajs) if cfg.algo.skip_uniform_groups else (list(trajs), 0)
        t1 = time.perf_counter()
        known, cached = live.known(train) if live is not None else None, None
        if live is None and train and _scores_from_cache(st.source, est, cfg.algo):
            known, cached, found = known_from_cache(train, st.source.scoring_policy, st.chat.answer_probe,
                                                    max_batch_tokens=cfg.algo.score_batch_tokens)
        scores = score_for(est, train, st.model, st.chat, cfg.algo, known=known) if train else Scores(metrics={})
        if cached is not None:  # probes off the served policy's cache: both passes together, as for a live scorer
            for k, v in cached.as_metrics().items():
                scores.metrics[k] = scores.metrics.get(k, 0.0) + v if k in _ADDITIVE else scores.metrics.get(k, v)
            scores.metrics["score/cached_states"] = float(found)
        t_score = time.perf_counter() - t1
        if live is not None:  # probes run during the rollout count as scoring, not generation
            t_gen -= live.stats.seconds
            t_score += live.stats.seconds
            for k, v in live.metrics().items():  # probe counts: both passes together
                scores.metrics[k] = scores.metrics.get(k, 0.0) + v if k in _ADDITIVE else v

        rows, adv_metrics, upd = [], {}, {}
        st.last_samples = []
        if train:  # every group uniform and skipped (or every rollout dropped): nothing to learn from
            res = step_advantages(train, cfg, scores, every=cfg.train.rollout_samples > 0)  # each estimator once
            adv_metrics = res.metrics
            rows = training_rows(train, res.advantages, est, res.layout)
            st.last_samples = _samples(cfg, train, scores, res, step + 1) if cfg.train.rollout_samples else []
        t2 = time.perf_counter()
        if rows:
            upd = update(st, rows, temperature=cfg.rollout.temperature)
        t_update = time.perf_counter() - t2

    total = time.perf_counter() - t0
    tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    m = rollout_metrics(train, None if scores.gains is None else scores.gains.numpy(),
                        None if scores.is_final is None else scores.unscored().numpy()) if train \
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
