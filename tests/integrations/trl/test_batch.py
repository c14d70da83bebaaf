"""The TRL path's batch math without TRL: ranks' shares of the global batch, and the per-rank variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mosaic.core.estimators import get_estimator
from mosaic.core.loss import token_weights
from mosaic.integrations.trl.batch import concat_scores, rank_batch, row_tensors, sample_indices
from mosaic.trace.graph import Session, Trajectory
from mosaic.trace.rows import turn_layout
from mosaic.train.batch import Scores, compute_advantages, training_rows
from mosaic.config.loader import load_config


def _trajs(seed: int = 0) -> list[Trajectory]:
    """3 groups x 4 samples, 1-3 sessions each (main / compaction / main ...), mixed rewards."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(3):
        for j in range(4):
            n = int(rng.integers(1, 4))
            sessions = []
            for k in range(n):
                kind = "main" if k % 2 == 0 or k == n - 1 else "compaction"
                c = int(rng.integers(2, 7))
                sessions.append(Session(id=k, kind=kind, prompt_ids=list(rng.integers(5, 50, 3)),
                                        completion_ids=list(rng.integers(5, 50, c)), loss_mask=[True] * c,
                                        logprobs=[-0.5] * c, parent=k - 1 if k else None,
                                        edge="continues" if k else None, is_final=k == n - 1))  # fmt: skip
            r = float(j % 2) if g < 2 else 0.0
            out.append(Trajectory(id=f"0/t{g}/{j}", task_id=f"t{g}", group_id=f"0/t{g}", sessions=sessions,
                                  reward=r, success=r >= 1.0))  # fmt: skip
    return out


def _scores(trajs, seed: int = 1) -> Scores:
    rng = np.random.default_rng(seed)
    final = torch.tensor([s.is_final for t in trajs for s in t.sessions])
    gains = torch.from_numpy(rng.normal(0, 1, len(final)).astype(np.float32)) * ~final
    turns = len(turn_layout(trajs).session)
    down = torch.from_numpy(rng.normal(0, 1, len(final)).astype(np.float32)) * ~final
    valid = torch.tensor([t.group_id != "0/t2" for t in trajs for _ in t.sessions])  # (a group with no reference)
    return Scores(gains=gains, is_final=final, turn_gains=torch.from_numpy(rng.normal(0, 1, turns).astype(np.float32)),
                  downstream=down, gain_valid=valid, downstream_how=["direct"] * len(final))


@pytest.fixture(scope="module")
def cfg():
    return load_config("cpu", overrides=["algo.estimator=mosaic", "algo.lam=0.5"])


def _split_scores(trajs, scores, cuts):
    out, s0, u0 = [], 0, 0
    for a, b in zip(cuts, cuts[1:]):
        s1 = s0 + sum(len(t.sessions) for t in trajs[a:b])
        u1 = u0 + len(turn_layout(trajs[a:b]).session)
        out.append(Scores(gains=scores.gains[s0:s1], is_final=scores.is_final[s0:s1],
                          turn_gains=scores.turn_gains[u0:u1], downstream=scores.downstream[s0:s1],
                          gain_valid=scores.gain_valid[s0:s1], downstream_how=scores.downstream_how[s0:s1]))
        s0, u0 = s1, u1
    return out


@pytest.mark.parametrize("estimator", ["broadcast", "mosaic-traj", "mosaic", "mosaic-dag", "turn-level", "fold"])
def test_ranks_together_give_the_one_process_batch(estimator):
    tiny_budget = ["harness.context_budget=8", "harness.max_new_tokens=2", "harness.summary_max_new_tokens=2"]
    cfg = load_config("cpu", overrides=[f"algo.estimator={estimator}", "algo.lam=0.5", *tiny_budget])
    trajs, scores = _trajs(), _scores(_trajs())
    cuts = [0, 6, 12]  # group t1 straddles the two ranks
    gathered = concat_scores(_split_scores(trajs, scores, cuts))
    assert torch.equal(gathered.gains, scores.gains) and torch.equal(gathered.turn_gains, scores.turn_gains)
    assert torch.equal(gathered.downstream, scores.downstream) and torch.equal(gathered.gain_valid, scores.gain_valid)
    adv, _ = compute_advantages(trajs, cfg, scores)
    rows = training_rows(trajs, adv, get_estimator(cfg.algo.estimator))
    w = token_weights([r.num_trainable for r in rows], [r.traj_index for r in rows], mode=cfg.algo.loss_agg)
    got_adv, got_tok, got_w = [], [], []
    for a, b in zip(cuts, cuts[1:]):
        rb = rank_batch(trajs, gathered, cfg, range(a, b), world_size=2)
        got_adv += [r.advantage for r in rb.rows]
        got_tok += [r.token_advantages for r in rb.rows]
        got_w += rb.weights.tolist()
    assert got_adv == pytest.approx([r.advantage for r in rows], abs=1e-7)
    assert got_tok == [r.token_advantages for r in rows]
    assert got_w == pytest.approx(w.tolist(), abs=1e-9)
    # the per-rank variant: other group statistics, z-scores and normalisers
    per_rank = [rank_batch(trajs, gathered, cfg, range(a, b), world_size=2, scope="rank")
                for a, b in zip(cuts, cuts[1:])]
    adv_rank = [r.advantage for rb in per_rank for r in rb.rows]
    assert max(abs(x - y) for x, y in zip(adv_rank, got_adv)) > 0.05


def test_sample_indices_number_rows_within_their_task():
    assert sample_indices(["a", "a", "b", "a", "b"]) == [0, 1, 0, 2, 1]


def test_row_tensors_pad_to_chunks_with_rows_that_train_nothing(cfg):
    trajs, scores = _trajs(), _scores(_trajs())
    rb = rank_batch(trajs, scores, cfg, range(0, 5), world_size=1)
    out = row_tensors(rb, pad_id=0, multiple=4)
    n = out["input_ids"].shape[0]
    assert n % 4 == 0 and all(v.shape[0] == n for v in out.values())
    trained = out["loss_mask"].sum(-1) > 0
    assert int(trained.sum()) < n  # the filler rows
    # the weights of the rank's tokens add up to the rank's share of the whole batch
    share = sum(float(w) * r.num_trainable for w, r in zip(rb.weights, rb.rows))
    assert float((out["token_weights"] * out["loss_mask"]).sum()) == pytest.approx(share, rel=1e-6)
    assert not bool((out["token_weights"][~out["loss_mask"]]).any())
