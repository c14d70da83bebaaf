"""samples.jsonl records (mosaic.train.samples): exact tokens back, every estimator's advantages as trained."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mosaic.core.estimators import ESTIMATORS
from mosaic.trace import turn_layout
from mosaic.train.batch import Scores, compute_advantages, estimator_params
from mosaic.config.loader import load_config
from mosaic.train.samples import all_estimator_advantages, mask_runs, sample_records
from tests.train.trajs import compaction_chain, fork


def _unruns(runs):
    out, on = [], False
    for n in runs:
        out += [on] * n
        on = not on
    return out


@given(st.lists(st.booleans(), max_size=60))
def test_mask_runs_round_trip(mask):
    runs = mask_runs(mask)
    assert _unruns(runs) == mask
    assert all(n > 0 for n in runs[1:])  # only the leading False run may be empty


def _batch():
    rng = random.Random(3)
    trajs = [compaction_chain(rng, 2, tid="a", reward=1.0), compaction_chain(rng, 1, tid="b", reward=0.0),
             compaction_chain(rng, 0, tid="c", reward=1.0), fork(rng, tid="d"), fork(rng, tid="e")]
    trajs[4].reward, trajs[4].success = 1.0, True  # group g2: one success, one failure
    return trajs


def _full_prompt(rec, k):
    s = rec["sessions"][k]
    if "prefix" not in s:
        return s["prompt"]
    p, n = s["prefix"]
    return (_full_prompt(rec, p) + rec["sessions"][p]["completion"])[:n] + s["prompt"]


def test_records_give_back_the_exact_tokens_masks_and_graph():
    trajs = _batch()
    cfg = load_config("cpu")
    advs, why = all_estimator_advantages(trajs, estimator_params(cfg.algo), context_budget=64)
    recs = sample_records(trajs, range(len(trajs)), step=7, estimator="broadcast", advantages=advs, unavailable=why)
    assert [r["trajectory"] for r in recs] == [t.id for t in trajs]
    assert any("prefix" in s for r in recs for s in r["sessions"])  # compaction prompts are not stored twice
    for t, r in zip(trajs, recs):
        assert r["step"] == 7 and r["reward"] == t.reward and r["group"]["size"] == 3 - (t.group_id == "g2")
        for k, s in enumerate(t.sessions):
            got = r["sessions"][k]
            assert _full_prompt(r, k) == s.prompt_ids
            assert got["completion"] == s.completion_ids
            assert _unruns(got["mask"]) == s.loss_mask
            assert (got["kind"], got["parent"], got["edge"], got["final"]) == (s.kind, s.parent, s.edge, s.is_final)
            assert got["gain"] is None  # none scored
    # no gains, multi-session rollouts: the gain estimators and grpo say why they are missing
    assert set(why) == {"grpo", "mosaic-session", "mosaic", "mosaic-dag", "turn-level"}
    assert "single-session" in why["grpo"] and "gains" in why["mosaic"]
    assert set(advs) == {"broadcast", "mosaic-traj", "fold"}


def test_every_estimator_in_a_record_is_what_the_trainer_trains_with():
    trajs = _batch()
    n_sessions = sum(len(t.sessions) for t in trajs)
    layout = turn_layout(trajs)
    gains = torch.linspace(-1, 2, n_sessions)
    turn_gains = torch.linspace(2, -1, len(layout.session))
    down = torch.linspace(1, -0.5, n_sessions) ** 2
    cfg = load_config("cpu")
    advs, why = all_estimator_advantages(trajs, estimator_params(cfg.algo), gains=gains, turn_gains=turn_gains,
                                         layout=layout, context_budget=cfg.harness.context_budget,
                                         downstream=down)  # fmt: skip
    assert set(why) == {"grpo"} and set(advs) == set(ESTIMATORS) - {"grpo"}
    how = ["direct"] * n_sessions
    recs = sample_records(trajs, [0, 3], step=1, estimator="mosaic", advantages=advs, unavailable=why, gains=gains,
                          turn_gains=turn_gains, layout=layout, downstream=down, downstream_how=how)  # fmt: skip
    offsets = {0: 0, 3: sum(len(t.sessions) for t in trajs[:3])}
    for name in advs:
        c = load_config("cpu", overrides=[f"algo.estimator={name}"])
        want, _ = compute_advantages(trajs, c, Scores(gains=gains, turn_gains=turn_gains, downstream=down),
                                     layout=layout)  # fmt: skip
        for i, rec in zip([0, 3], recs):
            for k, s in enumerate(rec["sessions"]):
                flat = offsets[i] + k
                if ESTIMATORS[name].level == "session":
                    assert s["adv"][name] == pytest.approx(float(want[flat]), rel=1e-5, abs=1e-6)
                else:
                    turns = [u for u, sess in enumerate(layout.session.tolist()) if sess == flat]
                    assert s["turn_adv"][name] == pytest.approx([float(want[u]) for u in turns], rel=1e-5, abs=1e-6)
    for i, rec in zip([0, 3], recs):
        for k, s in enumerate(rec["sessions"]):
            flat = offsets[i] + k
            assert s["gain"] == (None if trajs[i].sessions[k].is_final else pytest.approx(float(gains[flat]), rel=1e-5))
            if trajs[i].sessions[k].is_final:
                assert "downstream" not in s
            else:
                assert s["downstream"] == pytest.approx(float(down[flat]), rel=1e-5) and s["downstream_how"] == "direct"
            assert len(s["turn_gains"]) == len(s["turn_adv"]["fold"])


def test_sessions_without_a_reference_have_no_gain_in_the_samples():
    """§4.11: a session whose group had no success was not probed: its gain and downstream credit are null,
    not 0; no -0.0 is written."""
    trajs = _batch()
    n = sum(len(t.sessions) for t in trajs)
    valid = torch.tensor([t.group_id != trajs[0].group_id for t in trajs for _ in t.sessions])
    gains, down = torch.zeros(n) * -1.0, torch.linspace(-1, 1, n)
    recs = sample_records(trajs, range(len(trajs)), step=1, estimator="mosaic", advantages={}, unavailable={},
                          gains=gains, downstream=down, downstream_how=["direct"] * n, gain_valid=valid)  # fmt: skip
    for t, r in zip(trajs, recs):
        for s in r["sessions"]:
            if t.group_id == trajs[0].group_id or s["final"]:
                assert s["gain"] is None and "downstream" not in s
            else:
                assert s["gain"] == 0.0 and str(s["gain"]) == "0.0"


def test_a_service_outcome_rides_along_in_plain_fields_only():
    """The service family's ``traj.meta["env"]`` reaches the record (the viewer says why a trajectory with the
    right answer failed): numbers, booleans and short strings kept, lists and objects (the stale actions'
    details) left out; a trajectory without one has no ``env``."""
    trajs = _batch()
    trajs[0].meta["env"] = {"state_match": False, "answer_correct": True, "visits": 2, "visits_correct": 1,
                            "stale_actions": 1, "actions": 3, "stale_rate": 1 / 3, "answer_status": "ok",
                            "stale": [{"call": "create_order"}], "error": "x" * 500}
    recs = sample_records(trajs, range(len(trajs)), step=1, estimator=None, advantages={}, unavailable={})
    assert recs[0]["env"] == {"state_match": False, "answer_correct": True, "visits": 2, "visits_correct": 1,
                              "stale_actions": 1, "actions": 3, "stale_rate": 1 / 3, "answer_status": "ok"}
    assert all("env" not in r for r in recs[1:])
