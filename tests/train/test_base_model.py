"""The shipped embedded base model (``mosaic/assets/models/tiny-base``, built by ``mosaic pretrain``)."""

from __future__ import annotations

import json

import pytest
import torch

from mosaic.train import setup
from mosaic.config.loader import load_config
from mosaic.train.pretrain import META_FILE, base_model_dir


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cfg = load_config("cpu", overrides=[f"data.cache_dir={tmp_path_factory.mktemp('cache')}"])
    path = base_model_dir(cfg.model.embedded_preset)
    model, tok = setup.load_policy(path, device=torch.device("cpu"), dtype=torch.float32)
    return cfg, path, model, tok


def test_shipped_base_model_matches_its_recipe(base):
    from mosaic.agent.models.corpus import build_generator_tokenizer

    cfg, path, model, tok = base
    meta = json.loads((path / META_FILE).read_text())
    # Built for the preset that uses it: the same context budget and turn caps.
    assert meta["harness"] == {k: getattr(cfg.harness, k) for k in meta["harness"]}
    assert meta["embedded_preset"] == cfg.model.embedded_preset
    assert meta["parameters"] == sum(p.numel() for p in model.parameters())
    # The vocabulary is rebuilt exactly by the recipe (no hidden inputs).
    rebuilt = build_generator_tokenizer(vocab_size=meta["config"]["vocab_size"],
                                        n_worlds=meta["config"]["tokenizer_worlds"], harness_config=cfg.harness)
    assert rebuilt.get_vocab() == tok.get_vocab()


def test_base_model_solves_held_out_questions(base):
    """Greedy, through the multi-session harness, on the validation world (never trained on)."""
    from mosaic.train.evaluate import evaluate

    cfg, _, model, tok = base
    split = setup.load_split(cfg, "validation")
    r = evaluate(cfg, model, tok, setup.chat_format(tok), split, n_tasks=16, score_gains=False, progress=False)
    assert r.accuracy >= MIN_VALIDATION_ACCURACY, r.line()


MIN_VALIDATION_ACCURACY = 0.25


def test_the_service_warm_start_solves_part_of_both_families(tmp_path):
    """``tiny-svc`` (issue 29 item 5): the shipped tokenizer, and greedy through the harness it solves part of
    the service family's validation episodes and part of deep search's validation questions."""
    from mosaic.train.evaluate import evaluate

    cache = [f"data.cache_dir={tmp_path}"]
    svc = load_config("cpu-service", overrides=cache + ["model.base=tiny-svc"])
    path = setup.base_model_dir(svc.model.embedded_preset, svc.model.base)
    assert (path / "tokenizer.json").read_bytes() == (base_model_dir("tiny") / "tokenizer.json").read_bytes()
    model, tok = setup.load_policy(path, device=torch.device("cpu"), dtype=torch.float32)
    chat = setup.chat_format(tok)
    r = evaluate(svc, model, tok, chat, setup.load_split(svc, "validation"), n_tasks=16, progress=False)
    assert r.accuracy >= 2 / 16 and r.metrics["env/visits_correct"] > 0.4
    deep = load_config("cpu", overrides=cache)
    r = evaluate(deep, model, tok, chat, setup.load_split(deep, "validation"), n_tasks=16, progress=False)
    assert r.accuracy >= 2 / 16
