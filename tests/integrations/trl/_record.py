"""A recorded generation batch for the TRL tests: the shipped base model through the built-in harness."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from mosaic.agent.harness import DeepSearchEnv, Harness
from mosaic.trace.storage import write_jsonl
from mosaic.train import setup
from mosaic.config.loader import load_config

OVERRIDES = ["train.batch_tasks=4", "train.group_size=4", "algo.estimator=mosaic", "algo.lam=0.5"]
"""The Mosaic config both engines run in these tests (4 tasks x 4 samples, Mosaic with a visible gain term)."""


class Replay:
    """Our trainer's rollout source for the engine tests (``mosaic.train.sources.RolloutSource``): the
    recorded batch, every step; the trainer scores its gains after the rollout."""

    live_scorer = None

    def __init__(self, trajs):
        self.trajs = trajs

    def collect(self, tasks, step):
        return [t for t in self.trajs], {}

    def hold(self):
        return contextlib.nullcontext()

    def close(self):
        return None


def our_step(path: Path, monkeypatch) -> list[dict]:
    """One step of our trainer (``mosaic.train.rl.rl_step``) on the recorded batch at ``path``: per micro-batch,
    the packed ``input_ids`` / ``attention_mask`` / ``prompt_lens`` and what the loss was given (per-token
    ``advantages``, ``loss_mask``, ``token_weights``); first, one entry with the trained trajectories
    (``train``) and their session ``gains`` ((S,) in flatten order, as scored). ``monkeypatch`` wraps
    ``rl.score_for``, ``rl.collate`` and ``rl.policy_loss``."""
    from types import SimpleNamespace

    import mosaic.train.rl as rl
    from mosaic.train.optim import build_optimizer, build_scheduler
    from mosaic.trace.storage import read_jsonl

    cfg = load_config("cpu", overrides=OVERRIDES + ["train.rollout_samples=0"])
    model, tok = setup.build_base_model(cfg, torch.device("cpu"), torch.float32)
    trajs = read_jsonl(path)
    opt = build_optimizer(model, cfg.optim)
    st = rl.RLState(cfg=cfg, model=model, tokenizer=tok, chat=setup.chat_format(tok),
                    split=SimpleNamespace(tasks=[SimpleNamespace(id=t.task_id) for t in trajs]), optimizer=opt,
                    scheduler=build_scheduler(opt, cfg.optim, 1), device=torch.device("cpu"),
                    source=Replay(trajs))  # fmt: skip
    seen: list[dict] = []
    collate, loss, score = rl.collate, rl.policy_loss, rl.score_for

    def spy_score(est, train, *a, **kw):
        scores = score(est, train, *a, **kw)
        seen.append({"train": list(train), "gains": scores.gains})
        return scores

    def spy_collate(*a, **kw):
        b = collate(*a, **kw)
        seen.append({"input_ids": b.input_ids, "attention_mask": b.attention_mask, "prompt_lens": b.prompt_lens})
        return b

    def spy_loss(lp, old, adv, mask, w, **kw):
        seen[-1].update({"advantages": adv.detach().clone(), "loss_mask": mask.clone(), "token_weights": w.clone()})
        return loss(lp, old, adv, mask, w, **kw)

    monkeypatch.setattr(rl, "collate", spy_collate)
    monkeypatch.setattr(rl, "policy_loss", spy_loss)
    monkeypatch.setattr(rl, "score_for", spy_score)
    rl.rl_step(st, 0)
    return seen


def record(path: Path, *, tasks: int = 4, group: int = 4, seed: int = 3) -> Path:
    """Roll out ``tasks`` training questions ``group`` times each and write them to ``path`` (.jsonl)."""
    cfg = load_config("cpu", overrides=OVERRIDES)
    model, tok = setup.build_base_model(cfg, torch.device("cpu"), torch.float32)
    split = setup.load_split(cfg, "train")
    policy = setup.sampling_policy(cfg, model, tok, seed=seed)
    harness = Harness(policy, setup.chat_format(tok), DeepSearchEnv(split), cfg.harness)
    trajs = harness.run(split.tasks[:tasks], group_size=group, seed=seed, step=0)
    write_jsonl(path, trajs)
    return path


if __name__ == "__main__":  # python tests/integrations/trl/_record.py OUT.jsonl
    import sys

    from mosaic.trace.storage import read_jsonl

    out = record(Path(sys.argv[1]))
    trajs = read_jsonl(out)
    print(len(trajs), "trajectories,", sum(len(t.sessions) for t in trajs), "sessions, rewards",
          sorted({t.reward for t in trajs}), "kinds", sorted({s.kind for t in trajs for s in t.sessions}))
