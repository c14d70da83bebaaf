"""Equality across engines, verl's side: on one recorded batch (the TRL tests' recording: the shipped base
model through the built-in harness, 3 questions x 4 samples, Mosaic with a visible gain term), the
``mosaic_agent`` loop's rows through verl's v1 advantage path and verl's stock ``token-mean`` loss give
every trained token the coefficient our trainer's step gives it (advantage x loss weight), within 1e-6;
the session gains measured the verl way (prompt log-probs, one request per state) equal our scorer's.

Tokens are matched by their prefix (every id up to and including the token): verl trains one row per
session, our trainer packs a session that prefixes a longer one into it. Runs in .venv-verl.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import verl  # noqa: F401
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics
from verl.protocol import DataProto
from verl.trainer.ppo.v1 import utils as v1_utils

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trl"))
from _record import OVERRIDES, our_step, record  # noqa: E402

from mosaic.config.loader import load_config  # noqa: E402
from mosaic.integrations.verl.agent_loop import score_session_gains, session_outputs  # noqa: E402
from mosaic.train import setup  # noqa: E402

# default suite (in .venv-verl): ~40 s


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    path = record(tmp_path_factory.mktemp("rec") / "batch.jsonl", tasks=3, group=4)
    seen = our_step(path, mp)
    mp.undo()
    return seen


def _prefix_keys(ids: list[int], positions) -> list[int]:
    """A key per position: the hash of ids[: pos + 1] (rolling, so a long row costs O(n))."""
    h, want, keys = 0, set(positions), {}
    for j, t in enumerate(ids):
        h = hash((h, t))
        if j in want:
            keys[j] = (h, j)
    return [keys[p] for p in positions]


def _ours(seen) -> dict:
    out = defaultdict(list)
    n_tok = sum(int(b["loss_mask"].sum()) for b in seen if "input_ids" in b)
    for b in seen:
        if "input_ids" not in b:
            continue
        for i in range(b["input_ids"].shape[0]):
            n, p = int(b["attention_mask"][i].sum()), int(b["prompt_lens"][i])
            ks = torch.nonzero(b["loss_mask"][i]).flatten().tolist()
            for k, key in zip(ks, _prefix_keys(b["input_ids"][i, :n].tolist(), [p + k for k in ks]), strict=True):
                out[key].append(float(b["advantages"][i, k]) * float(b["token_weights"][i, k]) * n_tok)
    return {k: sorted(v) for k, v in out.items()}


def _verl_rows(train, gains):
    """The agent loop's outputs for each trajectory (verl keys ``{uid}_{sample}_{index}``) as a DataProto."""
    outs, keys, uids, flat = [], [], [], 0
    sample = defaultdict(int)
    for t in train:
        s_gains = gains[flat : flat + len(t.sessions)].tolist()
        flat += len(t.sessions)
        uid = f"u{t.group_id}"
        t.id = f"{uid}_{sample[uid]}"  # what the loop names a trajectory (verl's key)
        sample[uid] += 1
        o = session_outputs(t, s_gains, with_logprobs=False, metrics=AgentLoopMetrics())
        outs += o
        keys += [f"{t.id}_{i}" for i in range(len(o))]
        uids += [uid] * len(o)
    reward_of = {t.id: float(t.reward) for t in train}
    width = max(len(o.response_ids) for o in outs)
    mask = torch.zeros(len(outs), width)
    rewards = torch.zeros(len(outs), width)
    for r, o in enumerate(outs):
        mask[r, : len(o.response_mask)] = torch.tensor(o.response_mask, dtype=torch.float32)
        rewards[r, len(o.response_ids) - 1] = reward_of[o.extra_fields["mosaic_traj"]]
    cols = {c: np.array([o.extra_fields[c] for o in outs], dtype=object) for c in
            ("mosaic_traj", "mosaic_kind", "mosaic_final", "mosaic_sessions", "mosaic_gain", "mosaic_downstream")}
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": np.array(uids, dtype=object), **cols})  # fmt: skip
    return data, keys, outs


def test_verl_path_gives_every_token_our_advantage_times_weight(step):
    cfg = load_config("cpu", overrides=OVERRIDES)
    a = cfg.algo
    scoring = step[0]
    train, gains = scoring["train"], scoring["gains"]
    data, keys, outs = _verl_rows(train, gains)
    conf = OmegaConf.create({"norm_adv_by_std_in_grpo": a.norm_by_std, "mosaic": {
        "rho": a.rho, "delta": a.delta, "lam": a.lam, "eps": a.eps, "loss_agg": "trajectory-token-mean"}})
    adv = v1_utils.compute_advantage_for_multi_trajectories(data, keys, "mosaic", config=conf).batch["advantages"]
    # verl's token-mean: every trained token's coefficient is adv / (trained tokens); times the count, adv
    theirs = defaultdict(list)
    for r, o in enumerate(outs):
        ids, p = list(o.prompt_ids) + list(o.response_ids), len(o.prompt_ids)
        ks = [k for k, m in enumerate(o.response_mask) if m]
        for k, key in zip(ks, _prefix_keys(ids, [p + k for k in ks]), strict=True):
            theirs[key].append(float(adv[r, k]))
    theirs = {k: sorted(v) for k, v in theirs.items()}
    ours = _ours(step)
    assert theirs.keys() == ours.keys() and sum(map(len, ours.values())) > 100
    worst = max(abs(x - y) for k in ours for x, y in zip(ours[k], theirs[k], strict=True))
    assert worst <= 1e-6, worst
    assert any(abs(v[0]) > 1e-2 for v in ours.values())  # something to learn, not all zeros


def test_gains_measured_the_verl_way_equal_our_scorers(step):
    """The agent loop scores gains from prompt log-probs (one request per distinct state, as verl's rollout
    server answers them); here the server is the same model's full forward."""
    cfg = load_config("cpu", overrides=OVERRIDES)
    model, tok = setup.build_base_model(cfg, torch.device("cpu"), torch.float32)
    chat = setup.chat_format(tok)

    async def logprobs(ids):
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        return [0.0] + [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]

    train, gains = step[0]["train"], step[0]["gains"]
    flat, compared = 0, 0
    for t in train:
        ours = gains[flat : flat + len(t.sessions)].tolist()
        flat += len(t.sessions)
        theirs = asyncio.run(score_session_gains(t, chat.answer_probe(t.ground_truth), logprobs))
        for s, x, y in zip(t.sessions, ours, theirs, strict=True):
            if s.is_final:
                assert math.isnan(y)
                continue
            assert abs(x - y) <= 1e-4, (t.id, s.id, x, y)
            compared += 1
    assert compared >= 5
