"""The TRL path's rollout source without TRL: reset mode's partner (``harness.partner``) on its rows."""

from __future__ import annotations

import pytest
import torch

from mosaic.config.loader import load_config
from mosaic.integrations.trl.rollouts import HarnessRollouts
from mosaic.train import setup

ROLES = '["searcher: search and note what you find", "solver: use the notes, answer"]'


def _harness(partner: str):
    return load_config("cpu", overrides=["model.base=tiny-base2", "harness.mode=reset", "harness.reset_k=2",
                                         f"harness.reset_roles={ROLES}", f"harness.partner={partner}"])


@pytest.fixture(scope="module")
def world():
    cfg = _harness("self")
    model, tok = setup.build_base_model(cfg, torch.device("cpu"), torch.float32)
    return model, tok, setup.load_split(cfg, "train")


@pytest.mark.parametrize("partner", ["expert", "frozen"])
def test_a_partner_plays_the_second_role_and_its_rows_train_nothing(world, partner):
    model, tok, split = world
    frozen = setup.frozen_copy(model)
    src = HarnessRollouts(split, _harness(partner).harness, batch_size=8,
                          partner_model=frozen if partner == "frozen" else None)
    rows = [(split.tasks[i], j) for i in range(2) for j in range(2)]
    trajs = src.collect(rows, 0, model, tok, temperature=0.5, top_p=1.0, seed=3)
    assert [t.group_id for t in trajs] == [f"0/{task.id}" for task, _ in rows]
    sessions = [s for t in trajs for s in t.sessions]
    played = [s for s in sessions if s.meta.get("partner")]
    assert played and all(s.kind == "reset" for s in sessions)
    assert all(s.meta["role"] == 1 and s.meta["partner"] == partner and not any(s.loss_mask) for s in played)
    assert all(any(s.loss_mask) for s in sessions if not s.meta.get("partner") and s.num_turns)
    pol = src._partner([task for task, _ in rows], tok, temperature=0.5, top_p=1.0, seed=3)  # who played them
    assert pol.model is frozen if partner == "frozen" else type(pol).__name__ == "ExpertPolicy"


def test_a_frozen_partner_without_its_model_is_refused_before_any_rollout(world):
    with pytest.raises(ValueError, match="partner_model"):
        HarnessRollouts(world[2], _harness("frozen").harness)


def test_the_service_family_is_refused_in_one_line():
    cfg = load_config("cpu-service")
    with pytest.raises(ValueError, match="plays the deep-search family, not a ServiceSplit"):
        HarnessRollouts(setup.load_split(cfg, "train"), cfg.harness)
