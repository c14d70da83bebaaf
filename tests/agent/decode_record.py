"""Recorded rollouts of the shipped base model: the fixture ``data/decode_e59818e.json`` that
``test_policies_local_slab.py`` replays.

The file was written by this script at commit e59818e (the local policy's decode on HF's growing
``DynamicCache``): the CPU preset's compaction harness (shortened: ``HARNESS``) over a few test questions, G samples each, a
fixed sampling seed; every session's ids and sampled log-probs. The current decode must give the
same tokens (log-probs to float tolerance) for the same generator state.

    python tests/agent/decode_record.py tests/agent/data/decode_e59818e.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CASES = [  # (temperature, top_p, group size, max_batch_size, seed)
    (0.5, 1.0, 3, 64, 7),
    (1.0, 0.9, 2, 4, 11),
]
N_TASKS = 3
# Short runs that still compact (a 384-token budget) and fork sub-agents where the model asks.
HARNESS = ["harness.mode=compaction", "harness.context_budget=384", "harness.max_turns=4",
           "harness.max_total_turns=8", "harness.summary_max_new_tokens=48"]


def rollouts(temperature: float, top_p: float, group: int, batch: int, seed: int) -> list[dict]:
    """Trajectories of the shipped base model on the preset's first ``N_TASKS`` test questions."""
    import torch

    from mosaic.agent.harness import DeepSearchEnv, Harness
    from mosaic.agent.policies.local import LocalPolicy, LocalPolicyConfig
    from mosaic.train import setup
    from mosaic.config.loader import load_config

    cfg = load_config("cpu", overrides=HARNESS)
    model, tok = setup.load_policy(setup.base_model_dir("tiny"), device=torch.device("cpu"), dtype=torch.float32)
    chat = setup.chat_format(tok)
    split = setup.load_split(cfg, "test")
    policy = LocalPolicy(model, tok, LocalPolicyConfig(temperature=temperature, top_p=top_p,
                                                       max_batch_size=batch, seed=seed,
                                                       continuous_batching=False))  # (recorded in chunks)
    harness = Harness(policy, chat, DeepSearchEnv(split), cfg.harness)
    trajs = harness.run(split.tasks[:N_TASKS], group_size=group, seed=seed)
    return [{"id": t.id, "sessions": [{"ids": list(s.prompt_ids) + list(s.completion_ids), "logprobs": list(s.logprobs)}
                                      for s in t.sessions]} for t in trajs]


def main(out: str) -> None:
    record = {"cases": [{"params": list(c), "trajectories": rollouts(*c)} for c in CASES]}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record))
    n = sum(len(s["ids"]) for c in record["cases"] for t in c["trajectories"] for s in t["sessions"])
    print(f"wrote {out}: {n} ids")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(sys.argv[1])
