"""Session-graph data model: validation, rows, JSONL / Parquet storage."""

from __future__ import annotations

import json
import warnings

import pytest

from mosaic.trace import (
    BadRecordWarning,
    load_trajectories,
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


# ----------------------------------------------------------------------------- hostile files (issue 11)
# Types and ranges are checked, never coerced; every error names file:line (or row) and field;
# lenient=True skips bad records with counted warnings.
def _record(**session0):
    d = compaction_traj("bad").to_dict()
    d["sessions"][0].update(session0)
    return d


def _write_lines(path, trajs_dicts):
    path.write_text("".join(json.dumps({"schema": "mosaic.trajectory", "schema_version": 1, "trajectory": d}) + "\n"
                            for d in trajs_dicts))
    return path


# (mutation of session 0 or of the trajectory, expected fragment of the error)
CASES = [
    (dict(loss_mask=["false", True, False, False]), "session 0 field 'loss_mask[0]': must be true or false, got 'false'"),
    (dict(loss_mask=[1, 1, 0, 0]), "field 'loss_mask[0]': must be true or false, got 1"),
    (dict(prompt_ids=[1.9, 2, 3]), "session 0 field 'prompt_ids[0]': must be an integer, got 1.9"),
    (dict(prompt_ids=[1, "2", 3]), "field 'prompt_ids[1]': must be an integer, got '2'"),
    (dict(prompt_ids="abc"), "field 'prompt_ids': must be a list"),
    (dict(completion_ids=[10, -1, 90, 91]), "session 0 field 'completion_ids[1]': token id -1 is outside"),
    (dict(prompt_ids=[1, 2, 10**12]), "field 'prompt_ids[2]': token id 1000000000000 is outside"),
    (dict(prompt_ids=[1, 2, 2**31]), "field 'prompt_ids[2]': token id 2147483648 is outside"),
    (dict(logprobs=[float("nan"), -0.5, 0.0, 0.0]), "session 0 field 'logprobs[0]': log-prob nan is not finite"),
    (dict(logprobs=[-0.5, 3.0, 0.0, 0.0]), "field 'logprobs[1]': log-prob 3.0 is not finite and <= 0"),
    (dict(logprobs=[-0.5, float("-inf"), 0.0, 0.0]), "field 'logprobs[1]': log-prob -inf"),
    (dict(logprobs=[-0.5, "x", 0.0, 0.0]), "field 'logprobs[1]': must be a number"),
    (dict(state_before={"session": "0", "upto": 3}), "session 0 field 'state_before': field 'session': must be an integer"),
    (dict(state_after={"session": 0, "upto": "all"}), "field 'state_after': field 'upto': must be an integer"),
    (dict(is_final="yes"), "field 'is_final': must be true or false"),
    (dict(id="0"), "session 0 field 'id': must be an integer"),
    (dict(num_turns=-2), "session 0 field 'num_turns': -2 is negative"),
    (dict(meta=[1]), "field 'meta': must be an object"),
]


@pytest.mark.parametrize("mutation, fragment", CASES)
def test_jsonl_rejects_wrong_types_and_ranges_with_file_line_and_field(tmp_path, mutation, fragment):
    good = compaction_traj("ok").to_dict()
    p = _write_lines(tmp_path / "t.jsonl", [good, _record(**mutation)])
    with pytest.raises(StorageError) as exc:
        read_jsonl(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}:2: trajectory 'bad'"), msg
    assert fragment in msg, msg


@pytest.mark.parametrize("mutation, expected", [
    (lambda d: d.update(reward=float("nan")), "field 'reward': nan is not in [0, 1]"),
    (lambda d: d.update(reward="1"), "field 'reward': must be a number"),
    (lambda d: d.update(success="false"), "field 'success': must be true or false"),
    (lambda d: d.update(id=7), "trajectory field 'id': must be a string, got 7"),
    (lambda d: d.update(states=[[1, 2.5]]), "field 'states[0][1]': must be an integer"),
    (lambda d: d.update(states=[[1, -2]]), "field 'states[0][1]': token id -2 is outside"),
    (lambda d: d.pop("sessions"), "missing field 'sessions'"),
])
def test_jsonl_trajectory_level_fields(tmp_path, mutation, expected):
    d = compaction_traj("bad").to_dict()
    mutation(d)
    p = _write_lines(tmp_path / "t.jsonl", [d])
    with pytest.raises(StorageError, match=r"t\.jsonl:1: ") as exc:
        read_jsonl(p)
    assert expected in str(exc.value)


def test_duplicate_trajectory_ids_are_an_error(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", [compaction_traj("a"), compaction_traj("b"), compaction_traj("a")])
    assert p == 3
    with pytest.raises(StorageError, match=r"t\.jsonl:3: trajectory field 'id': duplicate id 'a' \(first at .*t\.jsonl:1\)"):
        read_jsonl(tmp_path / "t.jsonl")
    write_parquet(tmp_path / "t.parquet", [compaction_traj("a"), compaction_traj("a")])
    with pytest.raises(StorageError, match=r"t\.parquet: row 1: trajectory field 'id': duplicate id 'a'"):
        read_parquet(tmp_path / "t.parquet")


def test_writers_refuse_what_the_readers_reject(tmp_path):
    t = compaction_traj("a")
    t.sessions[0].logprobs[0] = 3.0
    with pytest.raises(Exception, match="log-prob 3.0"):
        write_jsonl(tmp_path / "w.jsonl", [t])
    with pytest.raises(Exception, match="log-prob 3.0"):
        write_parquet(tmp_path / "w.parquet", [t])
    t = compaction_traj("b")
    t.sessions[2].completion_ids[0] = -4
    with pytest.raises(Exception, match="token id -4"):
        write_parquet(tmp_path / "w.parquet", [t])


def test_lenient_skips_bad_records_with_counted_warnings(tmp_path):
    good = [compaction_traj(f"g{i}").to_dict() for i in range(3)]
    p = _write_lines(tmp_path / "t.jsonl", [good[0], _record(loss_mask=["false"] * 4), good[1],
                                             _record(prompt_ids=[1.9])])
    with p.open("a") as fh:  # a corrupt line in the middle, then a duplicate, then a good one
        fh.write("{not json\n")
        fh.write(json.dumps({"schema": "mosaic.trajectory", "schema_version": 1, "trajectory": good[0]}) + "\n")
        fh.write(json.dumps({"schema": "mosaic.trajectory", "schema_version": 1, "trajectory": good[2]}) + "\n")
    with pytest.raises(StorageError, match=r"t\.jsonl:2: "):
        read_jsonl(p)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = load_trajectories(p, lenient=True)
    assert [t.id for t in got] == ["g0", "g1", "g2"]
    msgs = [str(x.message) for x in w if issubclass(x.category, BadRecordWarning)]
    assert len(msgs) == 5, msgs
    assert any(":2: " in m and "loss_mask" in m for m in msgs) and any(":5: corrupted line" in m for m in msgs)
    assert any(":6: " in m and "duplicate id 'g0'" in m for m in msgs)
    assert msgs[-1].endswith("skipped 4 bad record(s) of 7 (lenient)")


def _table_with(tmp_path, name, fn):
    import pyarrow.parquet as pq

    src = tmp_path / "src.parquet"
    write_parquet(src, [compaction_traj("a"), compaction_traj("b")])
    t = fn(pq.read_table(src))
    out = tmp_path / name
    pq.write_table(t, out)
    return out


def test_parquet_bad_metadata_and_missing_column_are_clear_errors(tmp_path):
    bad_meta = _table_with(tmp_path, "m.parquet", lambda t: t.replace_schema_metadata({b"mosaic.schema": b"{oops"}))
    with pytest.raises(StorageError, match=r"m\.parquet: Parquet metadata 'mosaic.schema' is not a JSON object"):
        read_parquet(bad_meta)
    list_meta = _table_with(tmp_path, "l.parquet", lambda t: t.replace_schema_metadata({b"mosaic.schema": b"[1]"}))
    with pytest.raises(StorageError, match="is not a JSON object"):
        read_parquet(list_meta)
    no_sessions = _table_with(tmp_path, "s.parquet", lambda t: t.drop_columns(["sessions"]))
    with pytest.raises(StorageError, match=r"s\.parquet: missing column\(s\) 'sessions'"):
        read_parquet(no_sessions)


def test_parquet_bad_rows_name_row_and_field_and_lenient_skips(tmp_path):
    import pyarrow as pa

    def nan_logprob(t):
        rows = t.to_pylist()
        rows[1]["sessions"][0]["logprobs"][0] = float("nan")
        return pa.Table.from_pylist(rows, schema=t.schema)

    p = _table_with(tmp_path, "n.parquet", nan_logprob)
    with pytest.raises(StorageError, match=r"n\.parquet: row 1: trajectory 'b' session 0 field 'logprobs\[0\]'"):
        read_parquet(p)
    with pytest.warns(BadRecordWarning) as rec:
        assert [t.id for t in read_parquet(p, lenient=True)] == ["a"]
    assert [str(r.message).split(": ", 1)[1][:6] for r in rec] == ["row 1:", "skippe"]
    assert str(rec[1].message).endswith("skipped 1 bad record(s) of 2 (lenient)")

    def bad_meta_json(t):
        rows = t.to_pylist()
        rows[0]["sessions"][2]["meta"] = "{broken"
        return pa.Table.from_pylist(rows, schema=t.schema)

    p = _table_with(tmp_path, "j.parquet", bad_meta_json)
    with pytest.raises(StorageError, match=r"j\.parquet: row 0: .*session 2 field 'meta': not a JSON object"):
        read_parquet(p)
