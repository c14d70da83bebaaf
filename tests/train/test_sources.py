"""The one seam for rollouts: every ``rollout.source`` is a :class:`RolloutSource`, and the trainer
takes the built-in harness through it too."""

from __future__ import annotations

import pytest

from mosaic.train.external import ExternalRollouts
from mosaic.train.replay import RecordsReplay
from mosaic.train.sources import HarnessRollouts, RolloutSource

MEMBERS = ("collect", "hold", "close", "live_scorer")


@pytest.mark.parametrize("cls", [HarnessRollouts, ExternalRollouts, RecordsReplay])
def test_every_source_class_has_the_protocol_members(cls):
    made = object.__new__(cls)
    if cls is HarnessRollouts:
        made.live_scorer = None  # (set in __init__)
    assert isinstance(made, RolloutSource)
    for name in MEMBERS[:3]:
        assert callable(getattr(cls, name)), name


def test_a_source_without_hold_is_not_a_rollout_source():
    class Half:
        live_scorer = None

        def collect(self, tasks, step):
            return [], {}

        def close(self):
            pass

    assert not isinstance(Half(), RolloutSource)

