import dataclasses

import pytest

from mosaic.envs.deepsearch import (
    SplitConfig, check_disjoint, load_split, load_splits, split_config,
)
from mosaic.envs.world import WorldConfig, generate_world


def test_paper_splits_default_sizes_and_disjoint(tmp_path):
    splits = load_splits("paper", tmp_path)
    assert len(splits["train"].tasks) >= 1000
    assert len(splits["validation"].tasks) >= 300
    assert len(splits["test"].tasks) >= 500
    names = {s: sp.world.names() for s, sp in splits.items()}
    assert not names["train"] & names["validation"]
    assert not names["train"] & names["test"]
    assert not names["validation"] & names["test"]
    seeds = {sp.world.config.seed for sp in splits.values()}
    assert len(seeds) == 3
    # questions never mention another split's entity
    test_text = " ".join(t.question for t in splits["test"].tasks)
    assert not any(n in test_text for n in list(names["train"])[:300])


def test_cpu_preset_is_tiny_and_two_three_hops(tmp_path):
    splits = load_splits("cpu", tmp_path)
    for sp in splits.values():
        assert len(sp.world.entities) == 60
        assert {t.hops for t in sp.tasks} == {2, 3}


def test_split_is_cached_and_reloaded_identically(tmp_path):
    cfg = split_config("validation", "cpu")
    a = load_split("validation", cfg, tmp_path)
    files = list((tmp_path / "splits").iterdir())
    assert len(files) == 1
    b = load_split("validation", cfg, tmp_path)
    assert a.tasks == b.tasks and a.world.dumps() == b.world.dumps()
    assert not b.index.built


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MOSAIC_CACHE", str(tmp_path / "env"))
    load_split("test", split_config("test", "cpu"))
    assert (tmp_path / "env" / "splits").is_dir() and (tmp_path / "env" / "bm25").is_dir()


def test_split_config_enforces_name_partition():
    cfg = split_config("train", "cpu")
    with pytest.raises(ValueError, match="name_partition"):
        SplitConfig(split="test", world=cfg.world)
    with pytest.raises(ValueError, match="split"):
        load_split("test", cfg)


def test_check_disjoint_catches_shared_names():
    w = generate_world(WorldConfig(seed=1, n_entities=30))
    w2 = generate_world(WorldConfig(seed=2, n_entities=30))
    with pytest.raises(ValueError, match="same world seed"):
        check_disjoint({"a": w, "b": w})
    w2.entities[0].name = w.entities[0].name
    with pytest.raises(ValueError, match="share 1 entity names"):
        check_disjoint({"a": w, "b": w2})


def test_overrides_change_the_cache_key():
    a = split_config("train", "cpu")
    b = dataclasses.replace(a, n_tasks=10)
    assert a.key != b.key
