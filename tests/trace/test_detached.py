"""Detached stretches (``Session.detached``): stored and read back by every format, checked, and trained
as rows of their own with their session's advantage."""

from __future__ import annotations

import pytest
import torch

from mosaic.trace import (Session, StateRef, Stretch, TraceError, Trajectory, load_trajectories, read_parquet, to_rows,
                          turn_layout, validate, write_jsonl, write_parquet)
from mosaic.train.batch import training_rows


def compaction_traj() -> Trajectory:
    """main(0) → compaction(1) → main(2, final)."""
    def sess(k, kind, prompt, comp, mask, **kw):
        return Session(id=k, kind=kind, prompt_ids=prompt, completion_ids=comp, loss_mask=mask,
                       logprobs=[-0.5 if m else 0.0 for m in mask], **kw)
    m0 = sess(0, "main", [1, 2, 3], [10, 11, 90, 91], [True, True, False, False], state_before=StateRef(0, 3),
              state_after=StateRef(0, None))
    c1 = sess(1, "compaction", [1, 2, 3, 10, 11, 90, 91, 50], [20, 21], [True, True], parent=0, edge="continues")
    m2 = sess(2, "main", [1, 2, 3, 20, 21], [30, 31, 92, 32], [True, True, False, True], parent=1, edge="continues",
              is_final=True)
    return Trajectory(id="t0", task_id="task", group_id="g0", sessions=[m0, c1, m2], reward=1.0, success=True)


def _with_stretch():
    t = compaction_traj()
    t.sessions[0].detached = [Stretch(prompt_ids=[1, 2, 9], completion_ids=[5, 6, 7], loss_mask=[True, False, True],
                                      logprobs=[-0.5, 0.0, -0.25])]
    return validate(t)


def test_stretch_round_trips_jsonl_and_parquet(tmp_path):
    t = _with_stretch()
    write_jsonl(tmp_path / "t.jsonl", [t])
    write_parquet(tmp_path / "t.parquet", [t])
    for back in (load_trajectories(tmp_path / "t.jsonl")[0], read_parquet(tmp_path / "t.parquet")[0]):
        assert back.sessions[0].detached == t.sessions[0].detached
        assert back.sessions[1].detached == []
    assert "detached" not in compaction_traj().sessions[0].to_dict()  # the file format is unchanged without drift


def test_stretch_is_validated():
    t = _with_stretch()
    t.sessions[0].detached[0].loss_mask.pop()
    with pytest.raises(TraceError, match="detached"):
        validate(t)


def test_rows_train_the_stretch_with_its_sessions_advantage():
    t = _with_stretch()
    rows = to_rows([t], [0.5, -1.0, 2.0])
    own = [r for r in rows if r.stretch is None]
    extra = [r for r in rows if r.stretch is not None]
    assert len(own) == len(t.sessions) and len(extra) == 1
    assert (extra[0].session_index, extra[0].advantage, extra[0].prompt_ids) == (0, 0.5, [1, 2, 9])
    assert extra[0].num_trainable == 2
    assert rows.index(extra[0]) == 1  # right after its session's row
    with pytest.raises(ValueError, match="advantages"):
        to_rows([t], [0.0] * (len(t.sessions) + 1))


def test_turn_level_rows_give_the_stretch_its_sessions_mean_advantage():
    t = _with_stretch()
    layout = turn_layout([t])
    adv = torch.arange(len(layout.session), dtype=torch.float32)

    class TurnLevel:  # what training_rows reads of an estimator
        level = "turn"

    rows = training_rows([t], adv, TurnLevel(), layout)
    extra = next(r for r in rows if r.stretch is not None)
    own0 = next(r for r in rows if r.stretch is None and r.session_index == 0)
    assert extra.token_advantages == [own0.advantage] * 3 and extra.advantage == own0.advantage
