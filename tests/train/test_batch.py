import pytest
import torch

from mosaic.trace.graph import Session, Trajectory
from mosaic.trace.rows import to_rows
from mosaic.core.estimators import get_estimator
from mosaic.train.batch import Scores, compute_advantages, training_rows
from mosaic.config.loader import load_config


def _cfg(estimator):
    return load_config("cpu", overrides=[f"algo.estimator={estimator}"])


def _traj(i, reward, kinds_finals):
    ss = []
    for k, (kind, final) in enumerate(kinds_finals):
        ss.append(Session(id=k, kind=kind, prompt_ids=[1, 2], completion_ids=[3], loss_mask=[True], logprobs=[-1.0],
                          parent=None if k == 0 else k - 1, edge=None if k == 0 else "continues", is_final=final))
    return Trajectory(id=f"t{i}", task_id="q", group_id="g", sessions=ss, reward=reward, success=reward >= 1)


def test_spec_worked_example_through_the_glue():
    # docs/algorithm.md §4.6: rewards [1, 0, 1, 0], session counts [3, 5, 1, 1].
    trajs = [
        _traj(0, 1.0, [("main", False), ("compaction", False), ("main", True)]),
        _traj(1, 0.0, [("main", False), ("compaction", False), ("main", False), ("compaction", False), ("main", True)]),
        _traj(2, 1.0, [("main", True)]),
        _traj(3, 0.0, [("main", True)]),
    ]
    gains = [0.5, -0.2, 9.0, -0.1, -1.0, 0.3, -0.4, 7.0, 5.0, 0.2]
    adv, metrics = compute_advantages(trajs, _cfg("mosaic"), Scores(gains=torch.tensor(gains)))
    want = [0.7801, 0.7729, 0.6928, -0.8019, -0.8049, -0.6710, -0.6608, -0.6928, 1.0392, -1.0392]
    torch.testing.assert_close(adv, torch.tensor(want), atol=1e-4, rtol=0)
    rows = to_rows(trajs, adv.tolist())
    assert [r.advantage for r in rows] == pytest.approx(want, abs=1e-4)
    assert metrics["session/pos_gain_share/compaction"] == pytest.approx(0.0)
    b, _ = compute_advantages(trajs, _cfg("broadcast"))
    torch.testing.assert_close(b[:3], torch.full((3,), 0.8660), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="needs information gains"):
        compute_advantages(trajs, _cfg("mosaic"))


def _turn_traj(i, reward, prompt_len, masks, kind="main"):
    """A trajectory of one ``kind`` session per mask list (compactions between them omitted: only turns matter)."""
    ss = []
    for k, m in enumerate(masks):
        ss.append(Session(id=k, kind=kind, prompt_ids=[1] * prompt_len, completion_ids=[3] * len(m), loss_mask=m,
                          logprobs=[-1.0 if x else 0.0 for x in m], parent=None if k == 0 else k - 1,
                          edge=None if k == 0 else "continues", is_final=k == len(masks) - 1))
    return Trajectory(id=f"t{i}", task_id="q", group_id="g", sessions=ss, reward=reward, success=reward >= 1)


def test_turn_level_estimator_spreads_turn_advantages_over_each_turns_tokens():
    from mosaic.core.advantages import grpo, normalized_session_gains
    from mosaic.trace import turn_layout

    T, F = True, False
    trajs = [_turn_traj(0, 1.0, 4, [[T, T, F, F, T, F], [T, T]]), _turn_traj(1, 0.0, 4, [[F, T, F, T, T, F, F], [T]])]
    layout = turn_layout(trajs)
    # turns: t0 s0 [0,4) [4,6); t0 s1 [0,2) (answer turn); t1 s0 [0,3) [3,7); t1 s1 [0,1) (answer turn)
    assert layout.session.tolist() == [0, 0, 1, 2, 2, 3]
    assert list(zip(layout.start.tolist(), layout.end.tolist())) == [(0, 4), (4, 6), (0, 2), (0, 3), (3, 7), (0, 1)]
    assert layout.is_final.tolist() == [False, False, True, False, False, True]
    turn_gains = torch.tensor([0.4, -0.2, 3.0, 0.1, 0.5, 2.0])
    cfg = _cfg("turn-level")
    adv, m = compute_advantages(trajs, cfg, Scores(turn_gains=turn_gains), layout=layout)
    a = grpo(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    z = normalized_session_gains(turn_gains, torch.zeros(6, dtype=torch.long), torch.from_numpy(layout.is_final))
    want = a[torch.tensor([0, 0, 0, 1, 1, 1])] + cfg.algo.lam * z
    torch.testing.assert_close(adv.double(), want.double(), atol=1e-5, rtol=0)
    assert m["turn/pos_gain_share"] == pytest.approx(3 / 4)
    rows = training_rows(trajs, adv, get_estimator("turn-level"), layout)
    assert rows[0].token_advantages == pytest.approx([float(adv[0])] * 4 + [float(adv[1])] * 2)
    assert rows[2].token_advantages == pytest.approx([float(adv[3])] * 3 + [float(adv[4])] * 4)
    with pytest.raises(ValueError, match="turn-level gains"):
        compute_advantages(trajs, cfg)


def test_fold_estimator_penalises_main_turns_past_half_the_budget():
    T, F = True, False
    # budget 512 (cpu preset): a turn starting at context 300 is past half, one at 100 is not
    trajs = [_turn_traj(0, 1.0, 100, [[T, F, T]]), _turn_traj(1, 0.0, 300, [[T, F, T]])]
    cfg = _cfg("fold")
    assert cfg.harness.context_budget == 512
    adv, _ = compute_advantages(trajs, cfg)
    p = cfg.algo.fold_penalty
    torch.testing.assert_close(adv.double(), torch.tensor([0.7071, 0.7071, -0.7071 - p, -0.7071 - p]).double(),
                               atol=1e-4, rtol=0)
    rows = training_rows(trajs, adv, get_estimator("fold"))
    assert rows[1].token_advantages == pytest.approx([float(adv[2]), float(adv[2]), float(adv[3])])


def test_fold_flags_reset_turns_against_the_reset_budget():
    """In reset mode the agent's line of work is its reset sessions: fold flags their turns past half of
    ``harness.reset_context_budget`` (1024 here, against a main session's 512), never a summary's."""
    T, F = True, False
    cfg = load_config("cpu", overrides=["algo.estimator=fold", "harness.mode=reset"])
    assert (cfg.harness.context_budget, cfg.harness.budget("reset")) == (512, 1024)
    p = cfg.algo.fold_penalty
    trajs = [_turn_traj(0, 1.0, 300, [[T, F, T]], "reset"), _turn_traj(1, 0.0, 600, [[T, F, T]], "reset")]
    adv, _ = compute_advantages(trajs, cfg)  # 300 < 512 (not flagged although past a main session's half)
    torch.testing.assert_close(adv.double(), torch.tensor([0.7071, 0.7071, -0.7071 - p, -0.7071 - p]).double(),
                               atol=1e-4, rtol=0)
    summaries = [_turn_traj(0, 1.0, 900, [[T, F, T]], "compaction"), _turn_traj(1, 0.0, 900, [[T, F, T]], "compaction")]
    adv, _ = compute_advantages(summaries, cfg)
    torch.testing.assert_close(adv.double(), torch.tensor([0.7071] * 2 + [-0.7071] * 2).double(), atol=1e-4, rtol=0)
