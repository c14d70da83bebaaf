"""The verl plugin's estimator names and ``algorithm.mosaic`` keys come from the registry (no verl needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mosaic.core.estimators import ESTIMATORS, KNOBS, EstimatorParams, get_estimator
from mosaic.integrations.verl import estimator_names, not_registered
from mosaic.integrations.verl.rows import VERL_OWN_KEYS, VerlParams, advantage_batch_from_rows, row_advantages


def test_verl_takes_the_registry_names_and_their_spellings_and_says_why_not_the_others():
    names = estimator_names()
    skipped = not_registered()
    assert set(skipped) == {"grpo", "turn-level", "fold"}  # verl's own name; per-turn inputs (x2)
    assert set(names.values()) == set(ESTIMATORS) - set(skipped)
    for name, e in ESTIMATORS.items():
        if name not in skipped:
            assert {n for n, to in names.items() if to == name} == {name, *e.spellings()}
    assert names["mosaic_broadcast"] == "broadcast" and names["mosaic_traj"] == "mosaic-traj"


def test_verl_keys_are_the_knobs_its_estimators_read():
    read = {k for n in set(estimator_names().values()) for k in ESTIMATORS[n].knobs}
    assert VerlParams.keys() == [k for k in KNOBS if k in read and k not in VERL_OWN_KEYS] + [
        "success_threshold", "loss_agg"]
    assert {"rho", "delta", "lam", "eps"} <= set(VerlParams.keys()) and "gamma" not in VerlParams.keys()
    p = VerlParams.from_config({"mosaic": {"rho": 0.3, "loss_agg": "as-is", "eps": 1e-5}})
    assert (p.rho, p.lam, p.eps, p.loss_agg) == (0.3, KNOBS["lam"].default, 1e-5, "as-is")
    assert VerlParams.from_config({}) == VerlParams() and VerlParams().knobs == EstimatorParams()


@pytest.mark.parametrize("sub, why", [
    ({"rho": 1.0}, "algorithm.mosaic.rho must be in [0, 1) so the multiplier stays positive, got 1.0"),
    ({"norm_by_std": False}, "set verl's own algorithm.norm_adv_by_std_in_grpo instead"),
    ({"gamma": 0.5}, "unknown algorithm.mosaic keys ['gamma']"),
    ({"lam": "x"}, "algorithm.mosaic.lam must be a float, got 'x'"),
    ({"loss_agg": "sum"}, "algorithm.mosaic.loss_agg must be"),
])  # fmt: skip
def test_bad_verl_keys_fail_with_one_line(sub, why):
    with pytest.raises(ValueError) as exc:
        VerlParams.from_config({"mosaic": sub})
    assert why in str(exc.value) and "\n" not in str(exc.value)


def test_every_verl_name_runs_its_registry_estimator_with_the_configured_knobs():
    # two trajectories of one group: t0 (2 sessions, success), t1 (1 session, failure)
    uid, rewards = ["q", "q", "q"], np.array([0.0, 1.0, 0.0])
    cols = {"mosaic_traj": ["t0", "t0", "t1"], "mosaic_kind": ["main", "main", "main"],
            "mosaic_final": [False, True, True], "mosaic_sessions": [2, 2, 1], "mosaic_gain": [0.3, 0.0, 0.0],
            "mosaic_downstream": [0.7, float("nan"), float("nan")]}
    p = VerlParams.from_config({"mosaic": {"rho": 0.5, "lam": 0.2, "loss_agg": "as-is"}})
    for verl_name, name in estimator_names().items():
        got, _ = row_advantages(verl_name, rewards, uid, cols, torch.ones(3), p)
        want, _ = get_estimator(name)(advantage_batch_from_rows(rewards, uid, cols), EstimatorParams(rho=0.5, lam=0.2))
        torch.testing.assert_close(got, want.to(torch.float32))
    with pytest.raises(ValueError, match="unknown Mosaic verl estimator 'fold'"):
        row_advantages("fold", rewards, uid, cols, torch.ones(3), p)
    # the downstream column reaches mosaic-dag; without it (or NaN on a non-final row) mosaic-dag says so
    assert float(advantage_batch_from_rows(rewards, uid, cols).downstream[0]) == pytest.approx(0.7)
    no_d = {k: v for k, v in cols.items() if k != "mosaic_downstream"}
    with pytest.raises(ValueError, match="needs AdvantageBatch.downstream"):
        row_advantages("mosaic-dag", rewards, uid, no_d, torch.ones(3), p)
