import dataclasses
import re

import pytest

from mosaic.config.loader import (
    PRESETS,
    AlgoConfig,
    ConfigError,
    RolloutConfig,
    ModelConfig,
    OptimConfig,
    config_keys,
    dump_config,
    load_config,
    preset_config,
    resolve_steps,
)


def test_presets_build_and_paper_shape():
    for name in PRESETS:
        assert preset_config(name).preset == name
    paper = preset_config("paper")
    assert (paper.train.batch_tasks, paper.train.group_size, paper.data.preset, paper.train.steps) == (16, 8, "paper", 0)
    assert resolve_steps(paper, 1000) == 63  # one epoch: ceil(1000 / 16)
    cpu = load_config()
    assert cpu == preset_config("cpu") and cpu.model.source == "base" and cpu.model.embedded_preset == "tiny"
    assert (cpu.algo.clip_low, cpu.algo.clip_high, cpu.algo.kl_coef) == (0.2, 0.28, 0.05)  # the anchor, chosen on validation


def test_overrides_are_typed():
    c = load_config(overrides=["algo.lam=0.2", "optim.lr=1e-5", "optim.betas=[0.9, 0.95]", "train.resume=never",
                               "algo.clip_ratio_c=3", "data.hop_mix=[[2, 1], [4, 2]]", "algo.count_kinds=[main]"])
    assert c.algo.lam == 0.2 and c.optim.lr == 1e-5 and c.optim.betas == (0.9, 0.95)
    assert c.algo.clip_ratio_c == 3.0 and isinstance(c.algo.clip_ratio_c, float)
    assert c.data.hop_mix == ((2, 1.0), (4, 2.0)) and c.algo.count_kinds == ("main",)
    assert load_config(overrides=["algo.clip_ratio_c=null"]).algo.clip_ratio_c is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.algo.lam = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("algo.lamda=0.2", "unknown config key 'algo.lamda' (did you mean 'algo.lam'?)"),
        ("algos.lam=0.2", "unknown config key 'algos.lam' (did you mean 'algo.lam'?)"),
        ("algo=1", "config key 'algo' is a section"),
        ("algo.loss_agg=mean", "config key 'algo.loss_agg': must be one of"),
        ("algo.estimator=ppo", "config key 'algo.estimator': must be one of"),
        ("optim.lr=fast", "config key 'optim.lr': must be a number"),
        ("train.steps=2.5", "config key 'train.steps': must be an integer"),
        ("train.tensorboard=maybe", "config key 'train.tensorboard': must be true or false"),
        ("optim.betas=[0.9]", "config key 'optim.betas': must be a list of 2 items"),
        ("algo.rho=1.0", "config key 'algo.rho': must be in [0, 1)"),
        ("optim.lr=-1", "config key 'optim.lr': must be > 0"),
        ("harness.max_new_tokens=5000", "config key 'harness.max_new_tokens': must be < context_budget"),
        ("model.source=dir", "config key 'model.path': is required"),
        ("train.seed=99999999999999999999999", "config key 'train.seed': must be in [0, 9223372036854775807]"),
        ("model.init_seed=-1", "config key 'model.init_seed': must be in [0, "),
        ("data.world_entities=5", "config key 'data.world_entities': must be in [14, 1000000]"),
        ("model.path=/some/dir", "config key 'model.path': is read only with model.source=dir (model.source is 'base')"),
        ("algo.estimator=grpo", "config key 'algo.estimator': 'grpo' is single-session"),
        ("no_equals_sign", "must look like section.field=value"),
    ],
)
def test_bad_overrides_fail_with_the_key(override, fragment):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[override])
    assert fragment in str(exc.value)


@pytest.mark.parametrize("override", ["optim.lr=.inf", "rollout.temperature=.inf", "optim.lr=.nan",
                                      "rollout.temperature=.nan", "algo.lam=-.inf", "optim.lr=inf", "optim.lr=nan"])
def test_non_finite_numbers_are_rejected_with_the_key(override):
    # issue 11: `train optim.lr=.inf` and `rollout.temperature=.inf` were accepted (inf passes every "> 0").
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"config key '{re.escape(key)}': must be a finite number"):
        load_config(overrides=[override])


def test_grpo_with_single_mode_is_fine():
    c = load_config(overrides=["harness.mode=single", "algo.estimator=grpo"])
    assert c.algo.estimator == "grpo"


def test_yaml_file_and_round_trip(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("preset: smollm2\nalgo:\n  lam: 0.3\ntrain:\n  steps: 7\n")
    c = load_config(yaml_path=p, overrides=["train.steps=9"])
    assert c.preset == "smollm2" and c.model.source == "smollm2" and c.algo.lam == 0.3 and c.train.steps == 9
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(dump_config(c))
    assert load_config(yaml_path=dumped) == c
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'optim.learning_rate'"):
        load_config(yaml_path=bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(yaml_path=tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="unknown preset 'papr' \\(did you mean 'paper'\\?\\)"):
        load_config(preset="papr")


def test_harness_section_is_the_agent_harness_config():
    from mosaic.config.harness import HarnessConfig

    c = load_config(overrides=["harness.mode=fork", "harness.max_depth=2", "harness.search_k=5"])
    assert isinstance(c.harness, HarnessConfig) and (c.harness.max_depth, c.harness.search_k) == (2, 5)
    with pytest.raises(ConfigError, match="harness.*max_new_tokens"):
        load_config(overrides=["harness.max_new_tokens=5000"])
    with pytest.raises(ConfigError, match="unknown config key 'harness.temperature' \\(did you mean 'rollout.temperature'"):
        load_config(overrides=["harness.temperature=0.7"])


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match="'model.dtype'"):
        ModelConfig(dtype="fp8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'rollout.top_p'"):
        RolloutConfig(top_p=0.0)
    with pytest.raises(ConfigError, match="'optim.micro_batch_size'"):
        OptimConfig(micro_batch_size=0)
    with pytest.raises(ConfigError, match="'algo.estimator': must be one of .*turn-level"):
        AlgoConfig(estimator="igpo")


def test_keys_documented_and_consistent_with_peers():
    keys = config_keys()
    assert "algo.lam" in keys and "train.group_size" in keys and len(keys) == len(set(keys))
    from mosaic.core.loss import LOSS_AGG_MODES
    from mosaic.config.loader import EMBEDDED_PRESETS, LOSS_AGG

    assert set(LOSS_AGG) == set(LOSS_AGG_MODES)
    from mosaic.agent.models.embedded import PRESETS as EMB

    assert set(EMBEDDED_PRESETS) == set(EMB)

