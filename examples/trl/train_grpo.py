"""GRPO with TRL on Mosaic's multi-session deep-search rollouts (compaction, sub-agents, one row per session).

The shipped embedded base model (``mosaic/assets/models/tiny-base``) trains with TRL's ``GRPOTrainer``
(subclassed as ``MosaicGRPOTrainer``) on the deep-search world's training questions; the Mosaic
estimator computes each session's advantage over the whole batch of every process.

    accelerate launch --multi_gpu --num_processes 2 examples/trl/train_grpo.py --max_steps 2   # 2 CPU processes
    python examples/trl/train_grpo.py --max_steps 2                      # one process
    python examples/trl/train_grpo.py --set algo.estimator=broadcast      # any registered estimator

``use_cpu=True`` makes the torchrun processes ``--multi_gpu`` starts CPU processes (gloo);
``accelerate launch --cpu --num_processes 2`` starts ONE process (accelerate 1.15's ``--cpu`` launcher
forks nothing without ``mpirun``), which this script says when it sees it.
``--set`` takes Mosaic config overrides (``mosaic train``'s ``key=value``; preset ``cpu``); the TRL
arguments below default to the matching Mosaic values, so both trainers run the same setting.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model and the world are local

import torch  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from mosaic.integrations.trl import HarnessRollouts, MosaicGRPOTrainer, task_dataset  # noqa: E402
from mosaic.train import setup  # noqa: E402
from mosaic.config.loader import load_config  # noqa: E402
from mosaic.config.values import ConfigError  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default="runs/trl-grpo")
    p.add_argument("--max_steps", type=int, default=2)
    p.add_argument("--save_steps", type=int, default=0, help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="Mosaic config overrides")
    return p.parse_args()


def main() -> None:
    a = parse_args()
    try:
        cfg = load_config("cpu", overrides=a.set)
    except ConfigError as exc:  # a bad --set: one line, as `mosaic train` says it
        raise SystemExit(f"error: {exc}") from None
    model, tok = setup.build_base_model(cfg, torch.device("cpu"), torch.float32)
    split = setup.load_split(cfg, "train")
    # reset mode's frozen partner plays the second role from the warm start: copied before any update
    partner = setup.frozen_copy(model) if cfg.harness.partner == "frozen" else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if os.environ.get("ACCELERATE_USE_CPU") == "True" and "WORLD_SIZE" not in os.environ:
        print("[mosaic] one process: `accelerate launch --cpu` starts one; for several CPU processes use "
              "`accelerate launch --multi_gpu --num_processes N` (use_cpu=True keeps them on the CPU, gloo)")
    rows = cfg.train.batch_tasks * cfg.train.group_size  # prompts x samples of one step, over every process
    if rows % world:
        raise SystemExit(f"train.batch_tasks x train.group_size = {rows} rows do not split over {world} processes")
    args = GRPOConfig(
        output_dir=a.output_dir, max_steps=a.max_steps, logging_steps=1, report_to="none",
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500,
        use_cpu=True, bf16=False, gradient_checkpointing=False, seed=cfg.train.seed,
        per_device_train_batch_size=rows // world, num_generations=cfg.train.group_size,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        epsilon=cfg.algo.clip_low, epsilon_high=cfg.algo.clip_high, beta=cfg.algo.kl_coef,
        num_iterations=cfg.optim.ppo_epochs, learning_rate=cfg.optim.lr, lr_scheduler_type="constant",
        weight_decay=cfg.optim.weight_decay, adam_beta1=cfg.optim.betas[0], adam_beta2=cfg.optim.betas[1],
        max_grad_norm=cfg.optim.grad_clip, optim="adamw_torch",
    )  # fmt: skip
    try:
        trainer = MosaicGRPOTrainer(
            model=model, args=args, processing_class=tok, train_dataset=task_dataset(split.tasks),
            mosaic=cfg, rollouts=HarnessRollouts(split, cfg.harness, batch_size=cfg.rollout.batch_size,
                                                 partner_model=partner),
        )  # fmt: skip
    except ValueError as exc:  # a TRL setting this trainer cannot honour (check_args): one line
        raise SystemExit(f"error: {exc}") from None
    try:
        trainer.train()
    except ConfigError as exc:  # found once the harness is built (a reset budget that cannot hold a session)
        raise SystemExit(f"error: {exc}") from None
    trainer.save_model(a.output_dir)


if __name__ == "__main__":
    main()
