import pytest
import torch

from mosaic.trace.graph import Session, Trajectory
from mosaic.trace.rows import to_rows
from mosaic.train.batch import compute_advantages
from mosaic.train.config import AlgoConfig


def _traj(i, reward, kinds_finals):
    ss = []
    for k, (kind, final) in enumerate(kinds_finals):
        ss.append(Session(id=k, kind=kind, prompt_ids=[1, 2], completion_ids=[3], loss_mask=[True], logprobs=[-1.0],
                          parent=None if k == 0 else k - 1, edge=None if k == 0 else "continues", is_final=final))
    return Trajectory(id=f"t{i}", task_id="q", group_id="g", sessions=ss, reward=reward, success=reward >= 1)


def test_spec_worked_example_through_the_glue():
    # SPEC §4.6: rewards [1, 0, 1, 0], session counts [3, 5, 1, 1].
    trajs = [
        _traj(0, 1.0, [("main", False), ("compaction", False), ("main", True)]),
        _traj(1, 0.0, [("main", False), ("compaction", False), ("main", False), ("compaction", False), ("main", True)]),
        _traj(2, 1.0, [("main", True)]),
        _traj(3, 0.0, [("main", True)]),
    ]
    gains = [0.5, -0.2, 9.0, -0.1, -1.0, 0.3, -0.4, 7.0, 5.0, 0.2]
    adv, metrics = compute_advantages(trajs, AlgoConfig(estimator="mosaic"), gains)
    want = [0.7801, 0.7729, 0.6928, -0.8019, -0.8049, -0.6710, -0.6608, -0.6928, 1.0392, -1.0392]
    torch.testing.assert_close(adv, torch.tensor(want), atol=1e-4, rtol=0)
    rows = to_rows(trajs, adv.tolist())
    assert [r.advantage for r in rows] == pytest.approx(want, abs=1e-4)
    assert metrics["session/pos_gain_share/compaction"] == pytest.approx(0.0)
    b, _ = compute_advantages(trajs, AlgoConfig(estimator="broadcast"))
    torch.testing.assert_close(b[:3], torch.full((3,), 0.8660), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="needs information gains"):
        compute_advantages(trajs, AlgoConfig(estimator="mosaic"))
