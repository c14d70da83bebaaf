"""Supervised warm start on scripted-expert rollouts (``mosaic sft``).

The expert (``mosaic.agent.expert``) solves training questions through the
same harness the policy will use, so its trajectories carry every session kind
(main, compaction, subagent) with exact token records. SFT trains on the tokens
the expert "sampled" (``loss_mask`` True) and nothing else: the model learns to
search, summarise, delegate and answer — including the expert's deliberate
mistakes (``sft.expert_noise``), which is what RL is then meant to fix.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from mosaic.agent.expert import ExpertNoise, ExpertPolicy
from mosaic.agent.episode import make_env
from mosaic.agent.harness import Harness
from mosaic.trace import Trajectory, to_rows
from mosaic.train.batching import collate, completion_logprobs, length_groups, pack_rows, row_lengths
from mosaic.config.loader import Config
from mosaic.train.optim import lr_factor

log = logging.getLogger(__name__)


def expert_noise(rate: float):
    """``sft.expert_noise`` (one knob) → the expert's per-kind mistake rates.

    Our choice: early guesses and lossy summaries (the mistakes outcome reward and
    information gain can see) at ``rate``; wrong queries, redundant searches and
    extra sessions (which cost budget) at ``rate / 2``.
    """

    return ExpertNoise(wrong_query=rate / 2, redundant_search=rate / 2, early_guess=rate,
                       lossy_summary=rate, extra_session=rate / 2)  # fmt: skip


def expert_trajectories(cfg: Config, split, tokenizer, chat, *, n_tasks: int, seed: int = 0,
                        progress: bool = True) -> list[Trajectory]:
    """Roll the scripted expert over the first ``n_tasks`` tasks of ``split``."""

    tasks = split.tasks[:n_tasks]
    if getattr(split, "family", "deepsearch") == "service":  # the revalidating service expert (no noise knobs)
        from mosaic.agent.service_expert import ServiceExpertPolicy

        policy = ServiceExpertPolicy(tokenizer, tasks)
    else:
        policy = ExpertPolicy(tokenizer, tasks, expert_noise(cfg.sft.expert_noise), seed=seed)
    # (reset mode with a partner: the expert plays both roles; only its own role's sessions are trained)
    harness = Harness(policy, chat, make_env(split), cfg.harness,
                      partner=policy if cfg.harness.partner != "self" else None)
    return harness.run(tasks, group_size=1, seed=seed, progress=progress, step="sft")


def sft_step(model, rows: Sequence, opt: torch.optim.Optimizer, *, pad_id: int, device: torch.device,
             max_grad_norm: float = 1.0, max_tokens: int = 8192) -> float:
    """One optimizer step of token-mean cross-entropy on the sampled tokens of ``rows``; returns the loss.
    The rows run in micro-batches of similar length (``max_tokens`` padded positions each, gradients
    accumulated, the mean over the whole batch's tokens): one padded batch's loss and gradient without its
    padding."""
    groups = [collate(rows, g, pad_id=pad_id) for g in length_groups(row_lengths(rows), max_tokens)]
    n = max(1, sum(int(b.loss_mask.sum()) for b in groups))
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for batch in groups:
        batch = batch.to(device)
        lp, _ = completion_logprobs(model, batch)
        loss = -(lp * batch.loss_mask).sum() / n
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    return total


@dataclass
class SFTResult:
    steps: int
    final_loss: float
    losses: list[float]
    seconds: float
    rows: int
    tokens: int


def sft_train(model, trajs: Sequence[Trajectory], cfg: Config, *, pad_id: int, device: torch.device,
              seed: int = 0, progress: bool = True) -> SFTResult:
    """Next-token cross-entropy on sampled tokens only (token mean per optimizer step)."""

    s = cfg.sft
    sessions = [r for r in to_rows(trajs) if r.num_trainable > 0]
    if not sessions:
        raise ValueError("SFT data has no trainable tokens")
    # A main session trains inside the compaction that summarises it (its ids are that row's prefix).
    rows = pack_rows(sessions)
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(s.epochs):
        ep = list(range(len(rows)))
        rng.shuffle(ep)
        order += ep
    steps = math.ceil(len(order) / s.batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    # Linear warm-up, then cosine decay to 0 at the last step (the RL schedule's shape).
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: lr_factor(k, warmup_steps=s.warmup_steps, total_steps=steps, schedule="cosine"))
    model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(total=steps, desc="sft", disable=not progress)
    for k in range(steps):
        idx = order[k * s.batch_size : (k + 1) * s.batch_size]
        loss = sft_step(model, [rows[i] for i in idx], opt, pad_id=pad_id, device=device)
        sched.step()
        losses.append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    tokens = sum(r.num_trainable for r in sessions)
    return SFTResult(steps=steps, final_loss=sum(losses[-10:]) / len(losses[-10:]), losses=losses,
                     seconds=time.perf_counter() - t0, rows=len(sessions), tokens=tokens)  # fmt: skip
