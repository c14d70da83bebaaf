"""One TRL step of ``MosaicGRPOTrainer`` on a recorded batch; run inside ``.venv-trl`` (``python`` or
``accelerate launch --cpu --num_processes N``).

    runner.py TRAJS.jsonl OUT_DIR [--scope global|rank] [--capo]

Trains the shipped base model one step (plain SGD, so parameter changes are proportional to the
gradient: Adam's first step would turn tiny round-off differences into full ``lr``-sized steps)
and writes ``OUT_DIR/params.pt`` (rank 0: the parameters after the step) and
``OUT_DIR/batch-rank<r>.pt`` (every rank: the input ids, loss mask, per-token advantages and weights
the loss was given, and the rest of the row batch), plus ``OUT_DIR/metrics-rank<r>.json`` (TRL's logged metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from _record import OVERRIDES  # noqa: E402
from mosaic.integrations.trl import RecordedRollouts, task_dataset  # noqa: E402
from mosaic.integrations.trl.trainer import MosaicGRPOTrainer  # noqa: E402
from mosaic.train import setup  # noqa: E402
from mosaic.config.loader import load_config  # noqa: E402

LR = 0.05
KEYS = ("input_ids", "attention_mask", "completion_ids", "loss_mask", "old_logprobs", "prompt_lens",
        "completion_lens", "advantages", "token_rows", "token_weights")
"""What each ``compute_loss`` call is given and the runner keeps (a ``RowBatch`` and the token weights)."""


class Capturing(MosaicGRPOTrainer):
    """Keeps what each ``compute_loss`` call was given, and the logged metrics."""

    captured: list[dict]
    logged: list[dict]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.captured.append({k: inputs[k].detach().cpu() for k in KEYS})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def log(self, logs, start_time=None):
        super().log(logs, start_time)
        self.logged.append(dict(logs))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trajs")
    p.add_argument("out")
    p.add_argument("--scope", default="global", choices=["global", "rank"])
    p.add_argument("--capo", action="store_true", help="algo.capo=true (CAPO's routed gradient)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config("cpu", overrides=OVERRIDES + (["algo.capo=true"] if a.capo else []))
    model, tok = setup.build_base_model(cfg, torch.device("cpu"), torch.float32)
    rollouts = RecordedRollouts(a.trajs)
    tasks = rollouts.tasks()
    group = len(rollouts.by_task[tasks[0].id])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=1, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, bf16=False, gradient_checkpointing=False, seed=0,
        per_device_train_batch_size=len(tasks) * group // world, num_generations=group,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        epsilon=cfg.algo.clip_low, epsilon_high=cfg.algo.clip_high,
        optim="sgd", learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0,
    )  # fmt: skip
    trainer = Capturing(model=model, args=args, processing_class=tok, train_dataset=task_dataset(tasks),
                        mosaic=cfg, rollouts=rollouts, scope=a.scope)  # fmt: skip
    trainer.captured, trainer.logged = [], []
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save(trainer.captured, out / f"batch-rank{rank}.pt")
    (out / f"metrics-rank{rank}.json").write_text(json.dumps(trainer.logged))
    if rank == 0:
        params = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        torch.save({k: v.detach().cpu() for k, v in params.items()}, out / "params.pt")


if __name__ == "__main__":
    main()
