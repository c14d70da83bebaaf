"""Every path that reads capture records counts and names what it drops, the same way (issue 33, item 1).

Offline replay (``rollout.source=records``) read the records leniently, ignored the warnings and
printed ``dropped: none`` for 4 of 6 rollouts whose records had wrong types, while ``mosaic proxy
export`` on the same directory reported them. Both now share one reader and one drop report; so
does the trainer's live harness source.
"""

from __future__ import annotations

import json

import pytest

from mosaic.capture.records import CallRecord, RecordWriter, RewardRecord
from mosaic.cli import main

# rollout -> (line of its call, field, wrong value): the types a hand-edited or foreign file holds
BAD = {"r1": ("call", "prompt_ids", "1 2 3"), "r2": ("call", "logprobs", ["-0.1", "-0.2"]),
       "r3": ("reward", "reward", "1"), "r4": ("call", "seq", "3")}


def _records(d):
    """Six rollouts of one call and one reward each (three groups of two); four have a bad field."""
    d.mkdir()
    w = RecordWriter(d / "records.jsonl")
    for i in range(6):
        rid = f"r{i}"
        w.write(CallRecord(call_id=f"c{i}", rollout_id=rid, seq=i, endpoint="chat",
                           messages=[{"role": "user", "content": "q"}], prompt_ids=[1, 2, 3], completion_ids=[4, 5],
                           logprobs=[-0.1, -0.2], text="<answer>x</answer>", finish_reason="stop"))
        w.write(RewardRecord(rollout_id=rid, reward=float(i % 2), ground_truth="x", group_id=f"g{i // 2}"))
    w.close()
    lines = [json.loads(x) for x in (d / "records.jsonl").read_text().splitlines()]
    where = {}
    for n, rec in enumerate(lines):
        bad = BAD.get(rec["rollout_id"])
        if bad and bad[0] == rec["type"]:
            rec[bad[1]] = bad[2]
            where[rec["rollout_id"]] = f"{d / 'records.jsonl'}:{n + 1}"
    (d / "records.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return where


def test_replay_and_export_drop_the_same_rollouts_and_name_them_the_same_way(tmp_path, capsys):
    from mosaic.config.loader import load_config
    from mosaic.train.replay import RecordsReplay

    where = _records(tmp_path / "rec")
    cfg = load_config("cpu", overrides=["rollout.source=records", f"rollout.records={tmp_path / 'rec'}",
                                        f"train.run_dir={tmp_path / 'run'}"])
    replay = RecordsReplay(cfg)
    assert dict(replay.dropped) == {"bad_record": 4}  # was {} ("dropped: none")
    assert sum(len(g) for g in replay.groups.values()) == 2
    summary = replay.report.summary()
    assert summary.startswith("4 rollout(s) (bad_record 4): ")
    for rid, (_, field, _) in BAD.items():
        assert f"{rid!r} bad_record ({where[rid]}: " in summary and f"field '{field}" in summary
    (tmp_path / "run").mkdir()
    replay.write_drops(tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "drops.jsonl").read_text().splitlines()]
    assert sorted(r["rollout_id"] for r in rows) == sorted(BAD) and {r["reason"] for r in rows} == {"bad_record"}

    out = tmp_path / "s.jsonl"
    assert main(["proxy", "export", "--records", str(tmp_path / "rec"), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"dropped {summary}" in captured.err  # the very same line
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["dropped"] == {"bad_record": 4} and result["rollouts"] == 2


def test_replay_names_rollouts_it_cannot_use_for_other_reasons(tmp_path):
    from mosaic.config.loader import load_config
    from mosaic.train.replay import RecordsReplay

    d = tmp_path / "rec"
    _records(d)
    w = RecordWriter(d / "records.jsonl")
    w.write(CallRecord(call_id="c9", rollout_id="lonely", seq=9, endpoint="chat", prompt_ids=[1], completion_ids=[2],
                       logprobs=[-0.5]))  # no reward
    w.write(RewardRecord(rollout_id="ghost", reward=1.0))  # no call
    w.close()
    cfg = load_config("cpu", overrides=["rollout.source=records", f"rollout.records={d}"])
    replay = RecordsReplay(cfg)
    assert dict(replay.dropped) == {"bad_record": 4, "no_reward": 1, "no_calls": 1}
    s = replay.report.summary(limit=10)
    assert "'lonely' no_reward (no reward posted)" in s and "'ghost' no_calls (a reward but no call record)" in s


def test_the_live_source_drops_a_rollout_with_a_bad_record_by_name(tmp_path):
    from mosaic.train.external import DROP_REASONS, ExternalRollouts

    where = _records(tmp_path / "rec")
    src = object.__new__(ExternalRollouts)  # only its reader: no model, no proxy
    src.records_path = tmp_path / "rec" / "records.jsonl"
    calls, rewards, _, bad = src._read_new(0)
    assert bad == 4 and len(calls) == 3 and len(rewards) == 5  # r1, r2, r4: calls; r3: reward
    assert sorted(src.bad_records) == sorted(BAD) and "bad_record" in DROP_REASONS
    assert "field 'prompt_ids'" in src.bad_records["r1"] and str(src.records_path) in src.bad_records["r1"]
    assert where  # (the file holds the four bad lines)


def test_replay_drops_rollouts_with_token_ids_the_model_has_no_embedding_for(tmp_path):
    """Records written for another vocabulary used to crash training in the embedding lookup (an
    IndexError after the model loaded); they are now dropped as ``bad_token_ids``, named and counted."""
    from mosaic.config.loader import load_config
    from mosaic.train.replay import RecordsReplay

    d = tmp_path / "rec"
    _records(d)
    w = RecordWriter(d / "records.jsonl")
    for rid, ids in (("big", [1, 70000, 3]), ("neg", [1, -4, 3])):
        w.write(CallRecord(call_id=f"c-{rid}", rollout_id=rid, seq=0, endpoint="chat", prompt_ids=ids,
                           completion_ids=[4, 5], logprobs=[-0.1, -0.2], text="<answer>x</answer>", finish_reason="stop"))
        w.write(RewardRecord(rollout_id=rid, reward=1.0, ground_truth="x", group_id=f"g-{rid}"))
    w.close()
    cfg = load_config("cpu", overrides=["rollout.source=records", f"rollout.records={d}"])
    replay = RecordsReplay(cfg)
    assert dict(replay.dropped) == {"bad_record": 5}  # a negative id is already a bad field of its record
    assert replay.drop_outside_vocab(1024) == 1
    assert dict(replay.dropped) == {"bad_record": 5, "bad_token_ids": 1}
    assert "g-big" not in replay.group_ids and "g-neg" not in replay.group_ids
    s = replay.report.summary(limit=10)
    assert "'big' bad_token_ids (session 0 prompt_ids holds token id 70000, outside the model's vocabulary" in s
    assert "'neg' bad_record" in s
    with pytest.raises(ValueError, match="no usable rollout"):
        replay.drop_outside_vocab(3)  # every id >= 3 is now outside: nothing left
