"""Several processes, one answer: one TRL step with 2 processes moves the parameters as 1 process does.

Both runs train the shipped base model one step (plain SGD) on the same recorded batch (3 questions x
4 samples; the middle group in TRL's order straddles the two ranks). With the group statistics, the
per-kind gain z-scores and the trajectory-token-mean weights taken over the global batch the two
agree to float round-off; taken per rank (``scope="rank"``), they do not.

About 6-10 minutes on a loaded 2-core machine (recording the batch, three TRL runs), plus the TRL venv
build on first use.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.peer, pytest.mark.slow]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_processes_update_the_parameters_as_one(trl_run, base_params):
    one = torch.load(trl_run(1) / "params.pt")
    two = torch.load(trl_run(2) / "params.pt")
    step = _max_diff(one, base_params)
    assert step > 1e-5, "the step moved nothing: the comparison would be empty"
    assert _max_diff(two, one) <= 1e-3 * step


def test_per_rank_statistics_update_them_differently(trl_run, base_params):
    one = torch.load(trl_run(1) / "params.pt")
    per_rank = torch.load(trl_run(2, "rank") / "params.pt")
    step = _max_diff(one, base_params)
    assert _max_diff(per_rank, one) > 0.05 * step
