"""One config grammar for every verb: ``section.field=value`` (YAML values) over ``--preset`` (cpu by
default) and ``--config``, the same sections for ``data``, ``rollout``, ``eval`` and ``train``, one
cache directory, ``--help-config``; the older spellings still work with a deprecation line."""

from __future__ import annotations

import json

import pytest

from mosaic.cli import main

VERBS = (["train"], ["sft"], ["eval"], ["pretrain"], ["data", "generate"], ["data", "show"], ["rollout"])


@pytest.mark.parametrize("verb", VERBS, ids=" ".join)
def test_every_verb_prints_its_keys_with_defaults_and_docstrings(verb, capsys):
    assert main([*verb, "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "preset 'cpu'" in out  # one default preset
    assert "  data.seed = 0\n      Seed of the worlds and question samplers" in out
    assert "  data.cache_dir = .mosaic-cache\n" in out and "$MOSAIC_CACHE" in out
    if verb[0] in ("train", "rollout"):
        assert "  harness.context_budget = 512\n      Tokens a main session's context may reach" in out
    if verb[0] == "train":
        assert "  train.logger = null\n" in out and "  algo.estimator = mosaic\n" in out


@pytest.mark.parametrize("verb", VERBS, ids=" ".join)
def test_every_verb_takes_the_same_overrides(verb, capsys):
    assert main([*verb, "--print-config", "data.seed=3", "harness.context_budget=600"]) == 0
    out = capsys.readouterr().out
    assert "preset: cpu" in out and "seed: 3" in out and "context_budget: 600" in out
    assert main([*verb, "--print-config", "data.sede=3"]) == 2
    assert "unknown config key 'data.sede' (did you mean 'data.seed'?)" in capsys.readouterr().err


def test_data_new_and_old_spellings_give_the_same_split(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOSAIC_CACHE", str(tmp_path / "cache"))
    assert main(["data", "show", "--index", "0", "--json", "data.seed=1"]) == 0
    new = capsys.readouterr()
    assert (tmp_path / "cache").is_dir() and new.err == ""  # $MOSAIC_CACHE honoured, nothing deprecated
    assert main(["data", "show", "--index", "0", "--json", "--seed", "1", "--preset", "cpu"]) == 0
    old = capsys.readouterr()
    assert json.loads(old.out) == json.loads(new.out)
    assert "mosaic data show: --seed 1 is deprecated; write data.seed=1" in old.err
    assert main(["data", "show", "--index", "0", "--json", "data.seed=2"]) == 0
    assert json.loads(capsys.readouterr().out) != json.loads(new.out)


def test_data_builds_the_split_train_builds(tmp_path, capsys):
    from mosaic.envs.splits import load_split
    from mosaic.config.loader import load_config
    from mosaic.envs.splits import split_config_for

    over = [f"data.cache_dir={tmp_path}", "data.world_entities=80", "data.n_eval_tasks=7"]
    assert main(["data", "show", "--index", "6", "--json", *over]) == 0
    shown = json.loads(capsys.readouterr().out)
    cfg = load_config(overrides=over)
    split = load_split("validation", split_config_for(cfg, "validation"), tmp_path)
    assert len(split.tasks) == 7 and split.tasks[6].to_json() == shown


def test_rollout_harness_keys_match_the_old_set(tmp_path, capsys):
    common = ["rollout", "--n-tasks", "2", "--no-progress", f"data.cache_dir={tmp_path / 'c'}"]
    assert main([*common, "--out", str(tmp_path / "new.jsonl"), "harness.max_turns=2", "noise.wrong_query=0.5"]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "old.jsonl"), "--set", "max_turns=2",
                 "--set", "noise.wrong_query=0.5"]) == 0
    assert "--set KEY=VALUE is deprecated; write harness.KEY=VALUE" in capsys.readouterr().err

    def trajs(name):
        return [json.loads(line)["trajectory"] for line in (tmp_path / name).read_text().splitlines()]

    assert trajs("new.jsonl") == trajs("old.jsonl") and len(trajs("new.jsonl")) == 2


def test_one_cache_directory(tmp_path, monkeypatch):
    from mosaic.envs.cache import resolve_cache_dir

    monkeypatch.delenv("MOSAIC_CACHE", raising=False)
    assert str(resolve_cache_dir(".mosaic-cache")) == ".mosaic-cache"
    monkeypatch.setenv("MOSAIC_CACHE", str(tmp_path))
    assert resolve_cache_dir(".mosaic-cache") == tmp_path  # the default gives way to $MOSAIC_CACHE
    assert resolve_cache_dir(None) == tmp_path
    assert str(resolve_cache_dir("elsewhere")) == "elsewhere"  # an explicit data.cache_dir wins


def test_proxy_export_rules_take_section_field_values():
    from mosaic.capture.cli import parse_rules

    r = parse_rules(["rules.min_match_chars=8", "rules.link_by_output=false", "dedup_retries=false"])
    assert (r.min_match_chars, r.link_by_output, r.dedup_retries) == (8, False, False)


def test_pretrain_writes_into_the_package_only_when_asked(tmp_path, monkeypatch, capsys):
    import mosaic.train.pretrain as pt
    from mosaic.train.setup import BASE_MODELS_DIR

    seen = []
    monkeypatch.setattr(pt, "pretrain", lambda cfg, pc, out, **k: seen.append(str(out)) or
                        {"parameters": 1, "worlds": 0, "final_loss": 0.0, "seconds": 0.0})
    monkeypatch.chdir(tmp_path)
    assert main(["pretrain", "--steps", "1"]) == 0
    assert seen[-1] == "runs/pretrain/tiny-base"
    assert main(["pretrain", "--steps", "1", "--into-package"]) == 0
    assert seen[-1] == str(BASE_MODELS_DIR / "tiny-base")
    assert main(["pretrain", "--into-package", "--out", "x"]) == 2


def test_eval_says_which_model_before_evaluating(tmp_path, monkeypatch, capsys):
    from mosaic.train import entrypoints

    def stop(*a, **k):
        raise SystemExit(7)

    monkeypatch.setattr(entrypoints.setup, "load_policy", stop)
    with pytest.raises(SystemExit):
        main(["eval", f"train.run_dir={tmp_path / 'none'}"])
    out = capsys.readouterr().out
    assert "evaluating " in out and "tiny-base: the warm start of model.source=base (no checkpoint in " \
        f"train.run_dir={tmp_path / 'none'}" in out


def test_data_lists_its_keys_without_a_sub_command_and_points_overrides_to_one(capsys):
    assert main(["data", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "  data.seed = 0\n      Seed of the worlds and question samplers" in out and "harness." not in out
    assert main(["data", "--print-config", "--preset", "paper"]) == 0
    assert "preset: paper" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["data", "data.seed=3"])
    assert exc.value.code == 2 and "go after the sub-command (e.g. mosaic data generate data.seed=3)" in capsys.readouterr().err


@pytest.mark.parametrize("verb", (["train"], ["eval"], ["sft"]), ids=" ".join)
def test_set_on_verbs_that_never_had_it_points_to_the_new_grammar(verb, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*verb, "--set", "harness.context_budget=600"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unrecognized arguments: --set" in err
    assert "write section.field=value (YAML values) after the flags" in err


def test_old_flags_and_empty_keys_get_a_hint_naming_the_grammar(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--seed", "3"])
    assert exc.value.code == 2 and "train.seed=N (training) or data.seed=N" in capsys.readouterr().err
    assert main(["train", "=5", "--print-config"]) == 2
    assert "an override needs a key: section.field=value" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["harness.context_budget=600", "train"])
    assert "(e.g. mosaic train harness.context_budget=600)" in capsys.readouterr().err


def test_proxy_export_lists_its_rules(capsys):
    assert main(["proxy", "export", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "rules.min_match_chars = 16\n    shortest returned text" in out
    assert main(["proxy", "export", "--out", "x.jsonl"]) == 2
    assert "required: --records" in capsys.readouterr().err
