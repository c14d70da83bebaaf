"""``MosaicGRPOTrainer``: TRL's ``GRPOTrainer`` training on Mosaic's multi-session rollouts.

A subclass that overrides two methods and leaves the rest of TRL alone (its dataloader and
``RepeatSampler``, the buffering of a generation batch over ``steps_per_generation``, the optimizer,
scheduler, ``accelerate`` / DDP, logging, checkpoints):

- ``_generate_and_score_completions``: this rank's prompts (dataset rows naming a task) are rolled out
  by a rollout source (:mod:`.rollouts`), rewarded through TRL's reward functions (by default
  :func:`rollout_reward`, the reward the rollout recorded), scored for information gains with the model
  (when the estimator asks), gathered from every rank, and turned into advantages and loss weights over
  the **global** batch (:func:`~mosaic.integrations.trl.batch.rank_batch`); the rank keeps its own
  sessions, one training row per session (prefix sessions packed as in our trainer).
- ``compute_loss``: Mosaic's PPO clip-higher loss (:func:`mosaic.core.loss.policy_loss`) with those
  per-token weights and advantages, the recorded sampling log-probs as the old policy, times the
  number of processes (DDP averages gradients, so the ranks' sums add up to the global loss). With
  ``algo.capo=true``, a loss of the same value whose gradient is CAPO's routed one
  (:func:`mosaic.train.capo.routed_loss`), so TRL's single backward trains it.

Why not ``rollout_func`` or ``environment_factory``: both produce one completion per prompt row and
leave the advantage to TRL's group normalisation, which has no sessions, no per-session advantage and
no per-kind gain z-scores; one row per session needs a batch whose size the rollout decides.

TRL arguments that keep their meaning: ``num_generations`` (the group size), ``temperature`` and
``top_p`` (sampling and the ratio's temperature), ``epsilon`` / ``epsilon_high`` (the clip range),
``beta`` (k3 KL to TRL's reference model), ``num_iterations`` (PPO epochs over one generation batch),
``learning_rate`` and the rest of ``TrainingArguments``. The Mosaic config gives the estimator and its
knobs (``algo.*``: ``estimator``, ``lam``, ``rho``, ``delta``, ``loss_agg``, ``clip_ratio_c``, ...) and
the harness (``harness.*``). TRL's ``loss_type``, ``scale_rewards`` and ``max_completion_length`` are not
used (the estimator, the loss weights and ``harness.max_new_tokens`` replace them).
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from typing import Any

import torch
from accelerate.utils import gather_object
from trl import GRPOConfig, GRPOTrainer

from mosaic.core.estimators import get_estimator
from mosaic.core.loss import policy_loss
from mosaic.integrations.trl.batch import Scope, concat_scores, rank_batch, row_tensors, sample_indices
from mosaic.train import capo
from mosaic.train.batch import Scores, score_for
from mosaic.train.downstream import group_references
from mosaic.train.batching import RowBatch, completion_logprobs
from mosaic.config.loader import Config
from mosaic.train.metrics import rollout_metrics
from mosaic.train.setup import chat_format

__all__ = ["MosaicGRPOTrainer", "rollout_reward"]


def rollout_reward(completions, mosaic_reward, **kwargs) -> list[float]:
    """The reward the rollout recorded (the deep-search reward of the trajectory's answer, or the one a
    captured harness posted); TRL's default reward function for :class:`MosaicGRPOTrainer`."""
    return [float(r) for r in mosaic_reward]


def check_args(args: GRPOConfig, cfg: Config) -> None:
    """One-line errors for TRL settings this trainer cannot honour."""
    spg = args.steps_per_generation or args.gradient_accumulation_steps
    if spg != args.gradient_accumulation_steps:
        raise ValueError(f"steps_per_generation ({spg}) must equal gradient_accumulation_steps "
                         f"({args.gradient_accumulation_steps}): one optimizer step per generation batch, whose "
                         "loss weights are normalised over that batch")  # fmt: skip
    if args.use_vllm:
        raise ValueError("use_vllm: Mosaic's rollouts sample from the trained model itself (use_vllm=False)")
    if args.eval_strategy not in ("no", None) and str(args.eval_strategy) != "IntervalStrategy.NO":
        raise ValueError("eval_strategy: evaluate checkpoints with `mosaic eval` (TRL's eval loop has no harness)")
    if args.num_generations < 2:
        raise ValueError("num_generations must be >= 2 (the group size of the outcome advantage)")


def _combine(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' scorer metrics as one batch's: counts add up, seconds and the rest take the largest."""
    out: dict[str, float] = {}
    for m in per_rank:
        for k, v in m.items():
            out[k] = out.get(k, 0.0) + v if k.startswith("score/") else max(out.get(k, v), v)
    return out


class MosaicGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer(model, args=..., train_dataset=task_dataset(...), processing_class=tok)`` plus
    ``mosaic=`` (a Mosaic :class:`~mosaic.config.loader.Config`: estimator and harness) and ``rollouts=``
    (a :mod:`.rollouts` source). ``scope="rank"`` computes group statistics and normalisers per rank
    (for tests: it does not train like one process)."""

    def __init__(self, model, *, mosaic: Config, rollouts, args: GRPOConfig, processing_class, reward_funcs=None,
                 scope: Scope = "global", **kwargs: Any):  # fmt: skip
        check_args(args, mosaic)
        super().__init__(model=model, reward_funcs=reward_funcs or [rollout_reward], args=args,
                         processing_class=processing_class, **kwargs)  # fmt: skip
        self.mosaic = mosaic
        self.rollouts = rollouts
        self.scope = scope
        self.estimator = get_estimator(mosaic.algo.estimator)
        self.piece = capo.piece_fn(processing_class) if mosaic.algo.capo else None  # (CAPO's token types)
        self.chat = chat_format(processing_class) if (self.estimator.needs_gains or
                                                      "turn_gains" in self.estimator.needs) else None

    # ------------------------------------------------------------------ rollouts -> one rank's rows
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not self.model.training:
            raise ValueError("MosaicGRPOTrainer has no evaluation loop: evaluate with `mosaic eval`")
        acc, t0 = self.accelerator, time.perf_counter()
        local_ids = [str(x["task_id"]) for x in inputs]
        all_ids = gather_object(local_ids)
        counts = gather_object([len(local_ids)])
        start = sum(counts[: acc.process_index])
        local = range(start, start + len(local_ids))
        rows = [(self.rollouts.task(t), j) for t, j in zip(local_ids, sample_indices(all_ids)[start:local.stop])]
        step, model = self.state.global_step, acc.unwrap_model(self.model)
        seed = self.args.seed * 1_000_003 + step * acc.num_processes + acc.process_index
        trajs = self.rollouts.collect(rows, step, model, self.processing_class, temperature=self.temperature,
                                      top_p=self.top_p, seed=seed)  # fmt: skip
        t_gen = time.perf_counter() - t0
        self._reward(inputs, trajs, start)
        refs = None
        if self.mosaic.algo.gain_reference == "group":  # a group's samples may lie on several ranks
            outcomes = gather_object([(t.group_id, bool(t.success), t.answer) for t in trajs])
            refs = group_references([SimpleNamespace(group_id=g, success=ok, answer=a) for g, ok, a in outcomes])
        scores = self._score(model, trajs, refs)
        t_score = time.perf_counter() - t0 - t_gen
        all_trajs = gather_object(trajs)
        all_scores = concat_scores(gather_object([scores]))
        rb = rank_batch(all_trajs, all_scores, self.mosaic, local, world_size=acc.num_processes, scope=self.scope)
        out = row_tensors(rb, pad_id=self.processing_class.pad_token_id, multiple=self.args.steps_per_generation)
        m = rollout_metrics(all_trajs, None if all_scores.gains is None else all_scores.gains.numpy(),
                            None if all_scores.is_final is None else all_scores.unscored().numpy())  # fmt: skip
        m.update(rb.metrics)
        m.update(_combine(gather_object([scores.metrics or {}])))
        t_gen, t_score = (max(v) for v in zip(*gather_object([(t_gen, t_score)])))  # the slowest rank's
        m.update({"timing_s/gen": t_gen, "timing_s/score": t_score,
                  "train/sessions": float(sum(len(t.sessions) for t in all_trajs))})
        tokens = acc.reduce(torch.tensor(float(sum(len(r.prompt_ids) + len(r.completion_ids) for r in rb.rows))),
                            reduction="sum")  # fmt: skip
        self.state.num_input_tokens_seen += int(tokens.item())
        self._metrics["train"]["num_tokens"] = [self.state.num_input_tokens_seen]
        for k, v in m.items():
            self._metrics["train"][k].append(float(v))
        return {k: v.to(acc.device) for k, v in out.items()}

    def _reward(self, inputs: list[dict[str, Any]], trajs, start: int) -> None:
        """Rewards through TRL's reward functions (prompt: the question, completion: the final answer);
        the weighted sum replaces each trajectory's reward, and its success flag when the sum differs.
        ``start``: the rank's first row in the gathered batch."""
        prompts = [x["prompt"] for x in inputs]
        completions = [t.answer or "" for t in trajs]
        rich = [{**x, "mosaic_reward": t.reward} for x, t in zip(inputs, trajs)]
        per_func = self._calculate_rewards(rich, prompts, completions, [[] for _ in trajs])  # gathered (N, F)
        w = self.reward_weights.to(per_func.device)
        total = (per_func * w.unsqueeze(0)).nansum(dim=1)
        threshold = self.mosaic.harness.success_threshold
        for t, r in zip(trajs, total[start:start + len(trajs)].tolist()):
            if abs(r - t.reward) > 1e-6:  # (float32 sums of the default reward leave it alone)
                t.reward, t.success = float(r), r >= threshold
        for i, name in enumerate(self.reward_func_names):
            self._metrics["train"][f"rewards/{name}/mean"].append(torch.nanmean(per_func[:, i]).item())
        self._metrics["train"]["reward"].append(total.mean().item())
        self._metrics["train"]["reward_std"].append(total.std().item() if total.numel() > 1 else 0.0)

    def _score(self, model, trajs, refs=None) -> Scores:
        """The information gains the estimator asks for, with the rollout policy (before the update); ``refs``:
        the groups' references over all ranks (``algo.gain_reference=group``)."""
        if self.chat is None:
            return Scores(metrics={})
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return score_for(self.estimator, trajs, model, self.chat, self.mosaic.algo, refs=refs)
        finally:
            model.train(was_training)

    # ------------------------------------------------------------------ the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("MosaicGRPOTrainer does not return outputs")
        b = RowBatch(**{k: inputs[k] for k in ("input_ids", "attention_mask", "completion_ids", "loss_mask",
                                               "old_logprobs", "prompt_lens", "completion_lens", "advantages",
                                               "token_rows")})  # fmt: skip
        core, act, meter = self.accelerator.unwrap_model(model), None, contextlib.nullcontext()
        if self.mosaic.algo.capo:  # docs/algorithm.md §5.1: token types, and the units each activates more
            act, meter = capo.meter_for(core, b, self.piece)
        with meter:
            lp, ent = completion_logprobs(model, b, temperature=self.temperature, with_entropy=True)
        ref_lp = None
        if self.beta != 0.0:
            with torch.no_grad():
                ref_lp, _ = completion_logprobs(self.ref_model, b, temperature=self.temperature)
        kw = dict(clip_low=self.epsilon_low, clip_high=self.epsilon_high, clip_ratio_c=self.mosaic.algo.clip_ratio_c,
                  ref_logprobs=ref_lp, kl_coef=self.beta)  # fmt: skip
        w = inputs["token_weights"]
        res = policy_loss(lp, b.old_logprobs, b.advantages, b.loss_mask, w, entropy=ent, **kw)
        loss = res.loss
        if act is not None:  # one backward (TRL's): a loss whose gradient is the routed one
            la = policy_loss(lp, b.old_logprobs, b.advantages, b.loss_mask, w * act, **kw).loss
            lb = policy_loss(lp, b.old_logprobs, b.advantages, b.loss_mask, w * ~act, **kw).loss
            loss, m = capo.routed_loss(core, la, lb, meter.partitions())
            self._log_capo(m["capo/action_units"], m["capo/units"], float(act.sum()), float(b.loss_mask.sum()))
        self._log_loss_metrics(res.metrics)
        return loss * self.accelerator.num_processes

    def _log_capo(self, *counts: float) -> None:
        """CAPO's two shares over all ranks: units in the action partition, trained tokens that are action tokens."""
        a_units, units, a_tok, tok = self.accelerator.reduce(
            torch.tensor(counts, dtype=torch.float64, device=self.accelerator.device), reduction="sum").tolist()
        if units:
            self._metrics["train"]["capo/action_unit_share"].append(a_units / units)
        if tok:
            self._metrics["train"]["capo/action_token_share"].append(a_tok / tok)

    def _log_loss_metrics(self, metrics: dict[str, float]) -> None:
        """Weighted metrics add up over ranks and chunks (TRL averages the chunks' values: scaled back);
        extrema combine."""
        keys = sorted(metrics)
        vals = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.accelerator.device)
        total = self.accelerator.reduce(vals.clone(), reduction="sum")
        hi = self.accelerator.gather(vals.unsqueeze(0)).max(dim=0).values
        lo = self.accelerator.gather(vals.unsqueeze(0)).min(dim=0).values
        chunks = self.args.steps_per_generation
        for i, k in enumerate(keys):
            v = hi[i] if k.endswith("_max") else lo[i] if k.endswith("_min") else total[i] * chunks
            self._metrics["train"][k].append(float(v))
