"""Session-graph data model: validation, rows, JSONL / Parquet storage."""

from __future__ import annotations

import json
import warnings

import pytest

from mosaic.trace import (
    Session,
    StateRef,
    StorageError,
    TornLineWarning,
    TraceError,
    Trajectory,
    flatten,
    read_jsonl,
    read_parquet,
    to_rows,
    validate,
    write_jsonl,
    write_parquet,
    JsonlWriter,
)


def _sess(k, kind, prompt, completion, mask, *, parent=None, edge=None, final=False):
    return Session(
        id=k, kind=kind, prompt_ids=prompt, completion_ids=completion, loss_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask], parent=parent, edge=edge, is_final=final,
        end_reason="answer" if final else "compaction",
    )


def compaction_traj(tid="t0", group="g0", reward=1.0) -> Trajectory:
    """main(0) → compaction(1) → main(2, final), with a forked subagent(3) off main 2."""
    m0 = _sess(0, "main", [1, 2, 3], [10, 11, 90, 91], [True, True, False, False])
    c1 = _sess(1, "compaction", [1, 2, 3, 10, 11, 90, 91, 50], [20, 21], [True, True], parent=0, edge="continues")
    m2 = _sess(2, "main", [1, 2, 3, 20, 21], [30, 31, 92, 32], [True, True, False, True], parent=1,
               edge="continues", final=True)
    s3 = _sess(3, "subagent", [7, 8], [40, 41], [True, True], parent=2, edge="forks")
    m0.state_before, m0.state_after = StateRef(0, 3), StateRef(0, None)
    c1.state_before, c1.state_after = StateRef(0, None), StateRef(2, 5)
    m2.state_before, m2.state_after = StateRef(2, 5), StateRef(2, None)
    s3.state_before, s3.state_after = StateRef(2, 7), StateRef(2, 8)
    return Trajectory(id=tid, task_id="task", group_id=group, sessions=[m0, c1, m2, s3], reward=reward,
                      success=reward >= 1.0, answer="x", ground_truth="x", end_reason="answer")


def test_valid_and_shared_state_keys():
    t = validate(compaction_traj())
    # The compaction's before-state is main 0's after-state: one key, scored once.
    assert t.state_key(t.sessions[1].state_before) == t.state_key(t.sessions[0].state_after)
    assert t.state_key(t.sessions[1].state_after) == t.state_key(t.sessions[2].state_before)
    assert t.resolve_state(t.sessions[2].state_before) == [1, 2, 3, 20, 21]
    assert t.count_kinds() == {"main": 2, "compaction": 1, "subagent": 1}


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda t: setattr(t.sessions[0], "parent", 2) or setattr(t.sessions[0], "edge", "continues"), "parent"),
        (lambda t: setattr(t.sessions[0], "is_final", True), "is_final"),
        (lambda t: setattr(t.sessions[2], "is_final", False), "is_final"),
        (lambda t: t.sessions[1].loss_mask.append(True), "loss_mask"),
        (lambda t: t.sessions[1].logprobs.pop(), "logprobs"),
        (lambda t: setattr(t.sessions[1], "kind", "bogus"), "kind"),
        (lambda t: setattr(t.sessions[1], "edge", "sideways"), "edge"),
        (lambda t: setattr(t.sessions[1], "parent", 17), "parent"),
        (lambda t: setattr(t.sessions[1], "state_after", StateRef(2, 99)), "state_after"),
        (lambda t: setattr(t, "reward", float("nan")), "reward"),
    ],
)
def test_validation_names_the_field(mutate, field):
    t = compaction_traj()
    mutate(t)
    with pytest.raises(TraceError, match=field):
        validate(t)


def test_final_must_be_main():
    t = compaction_traj()
    t.sessions[2].is_final = False
    t.sessions[3].is_final = True
    with pytest.raises(TraceError, match="must be 'main'"):
        validate(t)


def test_flatten_and_rows():
    trajs = [compaction_traj("a", "g0", 1.0), compaction_traj("b", "g1", 0.0), compaction_traj("c", "g0", 0.0)]
    fb = flatten(trajs)
    assert fb.group_ids.tolist() == [0, 1, 0]
    assert fb.session_counts.tolist() == [4, 4, 4]
    assert flatten(trajs, count_kinds=["main"]).session_counts.tolist() == [2, 2, 2]
    assert fb.session_traj.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert fb.is_final.tolist() == [False, False, True, False] * 3
    rows = to_rows(trajs, advantages=list(range(12)))
    assert len(rows) == 12
    assert rows[5].input_ids == trajs[1].sessions[1].tokens()
    assert rows[5].advantage == 5.0 and rows[2].num_trainable == 3
    with pytest.raises(ValueError, match="advantages"):
        to_rows(trajs, advantages=[0.0])


def test_jsonl_round_trip_and_torn_line(tmp_path):
    path = tmp_path / "r.jsonl"
    trajs = [compaction_traj(f"t{i}", f"g{i % 2}", float(i % 2)) for i in range(5)]
    assert write_jsonl(path, trajs) == 5
    back = read_jsonl(path)
    assert [t.to_dict() for t in back] == [t.to_dict() for t in trajs]
    # Simulate a crash mid-write: half a record at the end.
    line = json.dumps({"schema": "mosaic.trajectory", "schema_version": 1, "trajectory": trajs[0].to_dict()})
    with open(path, "a") as fh:
        fh.write(line[: len(line) // 2])
    with pytest.warns(TornLineWarning):
        assert len(read_jsonl(path)) == 5
    # Appending after a crash cuts the torn tail off first, so the file stays readable.
    with pytest.warns(TornLineWarning):
        with JsonlWriter(path) as w:
            w.write(compaction_traj("t9"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [t.id for t in read_jsonl(path)][-1] == "t9"
    assert (tmp_path / "r.jsonl.torn").exists()


def test_jsonl_corrupt_middle_and_version(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [compaction_traj("a"), compaction_traj("b")])
    lines = path.read_text().splitlines()
    path.write_text(lines[0][:40] + "\n" + lines[1] + "\n")
    with pytest.raises(StorageError, match=r"bad.jsonl:1: corrupted"):
        read_jsonl(path)
    rec = json.loads(lines[0])
    rec["schema_version"] = 99
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(StorageError, match="schema_version 99"):
        read_jsonl(path)
    path.write_text(json.dumps({"hello": 1}) + "\n")
    with pytest.raises(StorageError, match="not a Mosaic trajectory"):
        read_jsonl(path)


def test_parquet_round_trip_and_errors(tmp_path):
    path = tmp_path / "d.parquet"
    trajs = [compaction_traj(f"t{i}") for i in range(3)]
    trajs[1].sessions[0].meta = {"tool_errors": 2}
    trajs[2].states = [[5, 6, 7]]
    trajs[2].sessions[3].state_before = StateRef(state=0)
    write_parquet(path, trajs)
    back = read_parquet(path)
    assert [t.to_dict() for t in back] == [t.to_dict() for t in trajs]
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(StorageError, match="not a readable Parquet"):
        read_parquet(path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1]}), path)
    with pytest.raises(StorageError, match="no Mosaic schema"):
        read_parquet(path)
