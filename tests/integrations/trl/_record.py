"""A recorded generation batch for the TRL tests: the shipped base model through the built-in harness."""

from __future__ import annotations

from pathlib import Path

import torch

from mosaic.agent.harness import DeepSearchEnv, Harness
from mosaic.trace.storage import write_jsonl
from mosaic.train import setup
from mosaic.config.loader import load_config

OVERRIDES = ["train.batch_tasks=4", "train.group_size=4", "algo.estimator=mosaic", "algo.lam=0.5"]
"""The Mosaic config both engines run in these tests (4 tasks x 4 samples, Mosaic with a visible gain term)."""


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
