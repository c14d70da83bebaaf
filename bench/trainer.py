"""Our RL step against TRL's ``GRPOTrainer`` on the same single-session GRPO job, and our multi-session step.

The job (both sides): the shipped embedded model and its tokenizer (the CPU preset's warm start), B
deep-search training questions per step as the same chat prompt (system + question, the exact ids our
harness feeds: TRL gets their text, which its tokenizer call turns back into the same ids — checked),
G samples each at temperature T, at most N new tokens, reward = exact match of the ``<answer>``, GRPO
advantages, one PPO epoch, one optimizer step per generation batch (AdamW, same lr), no KL, fp32, the
whole batch in one forward/backward (TRL's ``per_device_train_batch_size`` = ours ``optim.micro_batch_size``
= B x G).

- **ours**: ``mosaic.train.rl.rl_step`` — the trainer ``mosaic train`` runs — in single-session mode with
  one turn (``harness.mode=single harness.max_turns=1``, ``algo.estimator=grpo``);
- **TRL**: ``trl.GRPOTrainer`` 1.16 (``use_vllm=False``, ``bf16=False``, no gradient checkpointing: see
  NOTES), generation with ``transformers``' ``generate``, loss ``dapo`` (its default).

Steps alternate (a TRL step, then one of ours, ...; each side keeps its own model copy), so both see the
same machine load. Prints samples per second for both and the ratio (target: ours >= 1.3x TRL's), each
side's split into generation and the rest (scoring, advantages, forward/backward, optimizer), tokens per
row; then our multi-session step (the main job's compaction mode) against our single-session step (the
main job's harness with one session: ``harness.mode=single``) on the same tasks, per sampled token.

Runs inside ``<repo>/.venv-trl`` (built on first use from the ``trl`` extra with ``constraints-trl.txt``):

    python bench/trainer.py                     # B 8, G 8, 128 new tokens, 4 timed steps per side
    python bench/trainer.py --steps 8 --batch-tasks 4 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

_TRL_PROBE = "import trl, datasets, mosaic; print(trl.__version__)"


def _reexec_in_venv() -> None:
    """Run this script with the TRL venv's interpreter (built on first use)."""
    if os.environ.get("MOSAIC_BENCH_IN_VENV") == "trl":
        return
    from _peers import core_pin, ensure_venv

    py = ensure_venv(REPO, "trl", "trl", _TRL_PROBE, first=(core_pin(REPO, "torch"),), editable=True)
    os.environ["MOSAIC_BENCH_IN_VENV"] = "trl"
    os.execv(str(py), [str(py), __file__, *sys.argv[1:]])


def _our_state(overrides: list[str]):
    """An ``RLState`` for ``mosaic train`` with ``overrides`` (the CPU preset's warm start)."""
    from mosaic.train import setup
    from mosaic.config.loader import load_config
    from mosaic.train.entrypoints import ensure_warm_start
    from mosaic.train.optim import build_optimizer, build_scheduler
    from mosaic.train.rl import RLState

    cfg = load_config(preset="cpu", overrides=["train.heldout_split=none", "train.rollout_samples=0", *overrides])
    device = setup.resolve_device(cfg)
    model, tok = setup.load_policy(ensure_warm_start(cfg), device=device, dtype=setup.resolve_dtype(cfg, device))
    split = setup.load_split(cfg, "train")
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, 10_000)
    return RLState(cfg, model, tok, setup.chat_format(tok), split, opt, sched, device)


class _GenTimer:
    """Wraps ``model.generate`` to add up the seconds spent in it."""

    def __init__(self, model):
        self.seconds = 0.0
        self._inner = model.generate
        model.generate = self

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self._inner(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per side (after one warm-up step each)")
    ap.add_argument("--batch-tasks", type=int, default=8, help="B: prompts per step")
    ap.add_argument("--group-size", type=int, default=8, help="G: samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--multi-steps", type=int, default=3, help="steps of our multi- vs single-session comparison (0: skip)")
    args = ap.parse_args()
    _reexec_in_venv()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    import trl
    from transformers import PrinterCallback, TrainerCallback

    from mosaic.agent.policies.local import default_stop_ids
    from mosaic.envs.rewards import score_answer
    from mosaic.train.rl import rl_step, tasks_for_step

    B, G, N = args.batch_tasks, args.group_size, args.max_new_tokens
    total = args.steps + 1
    ours = _our_state([
        "harness.mode=single", "harness.max_turns=1", f"harness.max_new_tokens={N}", "harness.context_budget=2048",
        "algo.estimator=grpo", "algo.kl_coef=0", f"rollout.temperature={args.temperature}", "rollout.top_p=1.0",
        f"train.batch_tasks={B}", f"train.group_size={G}", f"optim.lr={args.lr}", "optim.warmup_steps=0",
        "optim.ppo_epochs=1", "optim.mini_batches=1", f"optim.micro_batch_size={B * G}", f"train.steps={total}",
    ])
    cfg, tok, chat = ours.cfg, ours.tokenizer, ours.chat
    # The same prompts: the tasks of our steps 0..total-1, as the exact text of the ids our harness feeds.
    rows, same_ids = [], 0
    for step in range(total):
        for task in tasks_for_step(ours.split, step, B, cfg.train.seed):
            ids, _ = chat.initial_prompt(cfg.harness.system_text(0), task.question)  # (ends with the header)
            text = tok.decode(ids)
            same_ids += tok(text, add_special_tokens=False)["input_ids"] == ids
            rows.append({"prompt": text, "answer": task.answer})
    print(f"prompts: {len(rows)} ({same_ids} re-tokenise to our exact ids), B {B} x G {G}, <= {N} new tokens, "
          f"T {args.temperature}, lr {args.lr}, threads {torch.get_num_threads()}, trl {trl.__version__}")

    def reward(completions, answer, **_):
        return [score_answer(c, a, "em").reward for c, a in zip(completions, answer)]

    trl_model = copy.deepcopy(ours.model)
    trl_model.generation_config.eos_token_id = list(default_stop_ids(trl_model, tok))  # our end-of-turn ids
    trl_model.generation_config.pad_token_id = tok.pad_token_id
    gen_timer = _GenTimer(trl_model)
    timings: dict[str, list[tuple[float, float, int]]] = {"ours": [], "trl": []}  # (step s, gen s, row tokens)

    class Interleave(TrainerCallback):
        """Times each TRL step and runs one of our steps between two TRL steps."""

        def __init__(self):
            self.t0 = self.g0 = 0.0
            self.k = 0

        def on_step_begin(self, a, state, control, **kw):
            self.t0, self.g0 = time.perf_counter(), gen_timer.seconds

        def on_step_end(self, a, state, control, **kw):
            dt, dg = time.perf_counter() - self.t0, gen_timer.seconds - self.g0
            timings["trl"].append((dt, dg, 0))
            m = rl_step(ours, self.k)
            self.k += 1
            timings["ours"].append((m["timing_s/step"], m["timing_s/gen"], 0))
            print(f"  step {self.k}: trl {dt:6.2f} s (generate {dg:5.2f}) | ours {m['timing_s/step']:6.2f} s "
                  f"(generate {m['timing_s/gen']:5.2f}, update {m['timing_s/update_actor']:5.2f}, "
                  f"{m['train/sessions']:.0f} rows)", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        targs = trl.GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=B * G, num_generations=G, max_completion_length=N,
            temperature=args.temperature, top_p=1.0, learning_rate=args.lr, lr_scheduler_type="constant",
            warmup_steps=0, max_steps=total, num_iterations=1, beta=0.0, bf16=False, gradient_checkpointing=False,
            use_vllm=False, report_to="none", logging_steps=1, save_strategy="no", use_cpu=True,
            dataloader_num_workers=0, shuffle_dataset=False, seed=0, disable_tqdm=True,
        )
        trainer = trl.GRPOTrainer(model=trl_model, reward_funcs=reward, args=targs, processing_class=tok,
                                  train_dataset=datasets.Dataset.from_list(rows), callbacks=[Interleave()])
        trainer.remove_callback(PrinterCallback)  # (its per-step metric dicts)
        trainer.train()

    print()
    print(f"{'side':<6}{'s/step':>9}{'samples/s':>11}{'generate s':>12}{'rest s':>9}   (medians of {args.steps} steps after "
          f"1 warm-up)")
    sps = {}
    for side in ("trl", "ours"):
        ts = timings[side][1:]
        step = statistics.median(t for t, _, _ in ts)
        gen = statistics.median(g for _, g, _ in ts)
        sps[side] = statistics.median(B * G / t for t, _, _ in ts)
        print(f"{side:<6}{step:>9.2f}{sps[side]:>11.2f}{gen:>12.2f}{step - gen:>9.2f}")
    print(f"ours / TRL samples per second: {sps['ours'] / sps['trl']:.2f}x  (target >= 1.3x)")

    if args.multi_steps:
        print()
        print("our multi-session step (compaction, the main job) vs our single-session step, same tasks:")
        for mode in ("compaction", "single"):
            st = _our_state([f"harness.mode={mode}", f"train.steps={args.multi_steps}"]
                            + (["harness.context_budget=2048", "harness.max_turns=24"] if mode == "single" else []))
            per_tok, steps = [], []
            for k in range(args.multi_steps):
                m = rl_step(st, k)
                toks = sum(int(t.meta.get("tokens_sampled", 0)) for t in st.last_trajs)
                per_tok.append(m["timing_s/step"] / max(1, toks))
                steps.append(m["timing_s/step"])
            print(f"  {mode:<11} {statistics.median(steps):7.2f} s/step, {1e3 * statistics.median(per_tok):6.2f} ms "
                  f"per sampled token")


if __name__ == "__main__":
    main()
