"""The Mosaic estimators through verl's own registry and dispatchers equal ``mosaic.core`` (runs in .venv-verl)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import verl  # noqa: F401  (loads the 'mosaic' plugin entry point, as in every verl process)
from verl.protocol import DataProto
from verl.trainer.ppo import core_algos, ray_trainer
from verl.trainer.ppo.v1 import utils as v1_utils

from _batch import random_case
from mosaic.core.estimators import get_estimator
from mosaic.integrations.verl import estimator_names, plugin
from mosaic.integrations.verl.advantages import estimator_fn

AS_IS = OmegaConf.create({"norm_adv_by_std_in_grpo": True, "mosaic": {"loss_agg": "as-is"}})


def _data(case) -> DataProto:
    return DataProto.from_dict(
        tensors={"token_level_rewards": case.token_level_rewards.clone(), "response_mask": case.response_mask},
        non_tensors={"uid": case.uid, **case.columns},
    )


def test_import_verl_registers_everything_through_the_entry_point():
    assert plugin.LOAD_ERROR is None
    for name in estimator_names():  # the registry's names and their other spellings (mosaic-traj, mosaic_traj)
        assert core_algos.get_adv_estimator_fn(name).__name__ == f"compute_{name}_advantage"
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    assert _agent_loop_registry["mosaic_agent"] == {"_target_": "mosaic.integrations.verl.agent_loop.MosaicAgentLoop"}
    assert getattr(ray_trainer.compute_advantage, "_mosaic_hook", False)
    assert getattr(v1_utils.compute_advantage_for_multi_trajectories, "_mosaic_hook", False)
    assert "verl.trainer.ppo.v1.trainer_base.PPOTrainer" in plugin.PATCHED


def test_mosaic_core_never_imports_verl():
    code = ("import sys, mosaic.core, mosaic.core.estimators, mosaic.integrations.verl, "
            "mosaic.integrations.verl.rows, mosaic.integrations.verl.reward; "
            "assert 'verl' not in sys.modules, 'verl imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("verl_name", sorted(estimator_names()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimator_through_verl_compute_advantage_equals_ours(verl_name, seed):
    case = random_case(seed)
    ours, _ = get_estimator(verl_name)(case.batch)  # (S,)
    out = ray_trainer.compute_advantage(_data(case), adv_estimator=verl_name, config=AS_IS)
    expect = ours[:, None].to(torch.float32) * case.response_mask
    torch.testing.assert_close(out.batch["advantages"], expect, rtol=1e-5, atol=1e-6)
    assert ours.abs().max() > 0.1  # not a vacuous comparison


@pytest.mark.parametrize("verl_name", sorted(estimator_names()))
def test_estimator_through_verl_v1_multi_trajectory_path_equals_ours(verl_name):
    case = random_case(7)
    ours, _ = get_estimator(verl_name)(case.batch)
    out = v1_utils.compute_advantage_for_multi_trajectories(_data(case), case.keys, verl_name, config=AS_IS)
    torch.testing.assert_close(out.batch["advantages"], ours[:, None].float() * case.response_mask, rtol=1e-5, atol=1e-6)


def test_mosaic_broadcast_equals_verls_own_multi_trajectory_grpo():
    """verl's v1 GRPO (last output's reward, broadcast) is broadcasting; ours gives the same rows."""
    case = random_case(3)
    theirs = v1_utils.compute_advantage_for_multi_trajectories(_data(case), case.keys, "grpo")
    ours = ray_trainer.compute_advantage(_data(case), adv_estimator="mosaic_broadcast", config=AS_IS)
    torch.testing.assert_close(ours.batch["advantages"], theirs.batch["advantages"], rtol=1e-5, atol=1e-5)


def test_spec_worked_example_through_verl():
    """docs/algorithm.md §4.6: one group, rewards [1,0,1,0], session counts [3,5,1,1], the listed gains."""
    traj = [0, 0, 0, 1, 1, 1, 1, 1, 2, 3]
    kind = ["main", "compaction", "main", "main", "compaction", "main", "compaction", "main", "main", "main"]
    gain = [0.5, -0.2, 9.0, -0.1, -1.0, 0.3, -0.4, 7.0, 5.0, 0.2]
    final = [False, False, True, False, False, False, False, True, True, True]
    reward = np.array([1, 0, 1, 0], dtype=np.float32)[traj]
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.from_numpy(reward)[:, None], "response_mask": torch.ones(10, 1)},
        non_tensors={"uid": np.array(["q"] * 10, dtype=object), "mosaic_traj": np.array(traj, dtype=object),
                     "mosaic_kind": np.array(kind, dtype=object), "mosaic_final": np.array(final),
                     "mosaic_sessions": np.array([3, 5, 1, 1])[traj], "mosaic_gain": np.array(gain)},
    )  # fmt: skip
    out = ray_trainer.compute_advantage(data, adv_estimator="mosaic", config=AS_IS)
    expect = [0.7801, 0.7729, 0.6928, -0.8019, -0.8049, -0.6710, -0.6608, -0.6928, 1.0392, -1.0392]
    np.testing.assert_allclose(out.batch["advantages"][:, 0].numpy(), expect, atol=1e-4)


def test_trajectory_token_mean_scaling_has_unit_token_mean_and_keeps_signs():
    case = random_case(4)
    plain = ray_trainer.compute_advantage(_data(case), adv_estimator="mosaic", config=AS_IS).batch["advantages"]
    scaled = ray_trainer.compute_advantage(_data(case), adv_estimator="mosaic").batch["advantages"]  # default
    m = case.response_mask.bool()
    assert torch.equal(torch.sign(plain[m]), torch.sign(scaled[m]))
    ratio = (scaled[m] / plain[m])[plain[m].abs() > 1e-6]
    assert float(ratio.max() - ratio.min()) > 0.1  # rows of different trajectories really are reweighted


def test_without_the_hook_the_registered_function_fails_loud():
    case = random_case(0)
    with pytest.raises(ValueError, match="per-row Mosaic columns"):
        estimator_fn("mosaic")(case.token_level_rewards, case.response_mask, index=case.uid, config=AS_IS)


def test_missing_columns_and_bad_rows_fail_loud():
    case = random_case(0)
    data = _data(case)
    del data.non_tensor_batch["mosaic_final"]
    with pytest.raises(ValueError, match="lacks the Mosaic columns"):
        ray_trainer.compute_advantage(data, adv_estimator="mosaic", config=AS_IS)
    data = _data(case)
    data.non_tensor_batch["mosaic_final"] = np.zeros(len(data), dtype=bool)
    with pytest.raises(ValueError, match="final rows"):
        ray_trainer.compute_advantage(data, adv_estimator="mosaic", config=AS_IS)
    with pytest.raises(ValueError, match="unknown algorithm.mosaic keys"):
        ray_trainer.compute_advantage(_data(case), adv_estimator="mosaic", config=OmegaConf.create({"mosaic": {"rhoo": 1}}))


def test_gain_estimators_need_scored_gains():
    case = random_case(5, gains=False)
    with pytest.raises(ValueError, match="needs AdvantageBatch.gains"):
        ray_trainer.compute_advantage(_data(case), adv_estimator="mosaic", config=AS_IS)
    ray_trainer.compute_advantage(_data(case), adv_estimator="mosaic_traj", config=AS_IS)  # no gains needed


def test_verls_own_estimators_are_untouched_by_the_hook():
    case = random_case(6)
    data = _data(case)
    out = ray_trainer.compute_advantage(data, adv_estimator="grpo")
    ref, _ = core_algos.compute_grpo_outcome_advantage(case.token_level_rewards, case.response_mask, case.uid)
    torch.testing.assert_close(out.batch["advantages"], ref)


def test_verls_synthetic_padding_rows_train_nothing_and_leave_the_real_rows_as_they_were():
    """verl's v1 trainer pads a batch to its mini-batch multiple with copies of the first row under keys of
    their own (``upsample_batch_to_divisible_size``); copying a final row must not make a second final
    session of that trajectory (found running verl's trainer on CPU: the estimator refused the batch)."""
    from mosaic.integrations.verl import advantages

    case = random_case(5)
    ours, _ = get_estimator("mosaic")(case.batch)
    src = int(np.flatnonzero(case.columns["mosaic_final"])[0])  # a final row, copied as verl's template
    n_pad, width = 2, case.response_mask.shape[1]
    cols = {k: np.concatenate([v, np.repeat(v[src : src + 1], n_pad)]) for k, v in case.columns.items()}
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.cat([case.token_level_rewards, torch.zeros(n_pad, width)]),
                 "response_mask": torch.cat([case.response_mask, torch.zeros(n_pad, width)])},
        non_tensors={"uid": np.concatenate([case.uid, np.array(["padabc"] * n_pad, dtype=object)]), **cols},
    )  # fmt: skip
    keys = case.keys + [f"padabc_{i}_0" for i in range(n_pad)]
    out = v1_utils.compute_advantage_for_multi_trajectories(data, keys, "mosaic", config=AS_IS)
    s = len(case.keys)
    torch.testing.assert_close(out.batch["advantages"][:s], ours[:, None].float() * case.response_mask, rtol=1e-5, atol=1e-6)
    assert out.batch["advantages"][s:].abs().sum() == 0 and out.batch["returns"][s:].abs().sum() == 0
    assert advantages.LAST_METRICS["mosaic/verl_padding_rows"] == n_pad
    assert advantages.real_rows(keys, cols["mosaic_traj"]).tolist() == [True] * s + [False] * n_pad


def test_minibatch_count_says_when_verl_takes_several_optimizer_steps(caplog):
    from mosaic.integrations.verl import advantages

    cfg = OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 8}, "rollout": {"n": 2}}})
    assert advantages.minibatches(16, cfg) == 1 and advantages.minibatches(12, cfg) == 1
    advantages._WARNED.discard("minibatches")
    with caplog.at_level("WARNING"):
        assert advantages.minibatches(48, cfg) == 3
    assert "3 optimizer steps" in caplog.text and "use_dynamic_bsz" in caplog.text
