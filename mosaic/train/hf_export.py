"""What a saved model says about how to sample it, and the final model of a run in Hugging Face's layout.

:func:`set_sampling_defaults` writes into ``model.generation_config`` (saved beside the weights as
``generation_config.json`` by every ``save_pretrained``: checkpoints, the SFT model, the final model)
the sampling the policy was trained at, as the standard fields a server reads for its defaults
(``do_sample``, ``temperature``, ``top_p``, ``max_new_tokens``; vLLM and ``transformers``' ``generate``
take them), and under ``mosaic`` both that and how it was evaluated (temperature, samples per question,
split)::

    {"do_sample": true, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 128, ...,
     "mosaic": {"rollout": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 128},
                "evaluation": {"temperature": 0.0, "do_sample": false, "samples_per_question": 1,
                               "split": "test"}}}

:func:`save_final_model` writes ``<run_dir>/final/`` once the last step is done: weights
(safetensors), ``config.json``, ``generation_config.json`` and the tokenizer (with its ``auto_map``, so
``AutoTokenizer`` loads the saved tokenizer and not the one the architecture's name suggests), replaced
whole (written beside it, then renamed), loadable by ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mosaic.agent.models.embedded import save_model

__all__ = ["FINAL_DIR", "set_sampling_defaults", "save_final_model"]

FINAL_DIR = "final"
"""The run directory's sub-directory holding the final model."""


def set_sampling_defaults(model, cfg) -> None:
    """``model.generation_config`` ← the rollout sampling of ``cfg`` (and, under ``mosaic``, its evaluation)."""
    g = model.generation_config
    rollout = {"temperature": float(cfg.rollout.temperature), "top_p": float(cfg.rollout.top_p),
               "max_new_tokens": int(cfg.harness.max_new_tokens)}
    g._from_model_config = False  # set on purpose: loaders keep every field (with True they drop ``mosaic``)
    g.do_sample = True
    g.temperature, g.top_p, g.max_new_tokens = rollout["temperature"], rollout["top_p"], rollout["max_new_tokens"]
    g.mosaic = {"rollout": rollout,
                "evaluation": {"temperature": float(cfg.train.eval_temperature),
                               "do_sample": cfg.train.eval_temperature > 0,
                               "samples_per_question": int(cfg.train.eval_samples),
                               "split": cfg.train.heldout_split}}


def save_final_model(run_dir: str | Path, model, tokenizer) -> Path:
    """``<run_dir>/final/`` in Hugging Face's layout, replaced whole; returns its path."""
    run_dir = Path(run_dir)
    final, tmp, old = (run_dir / FINAL_DIR, run_dir / f"{FINAL_DIR}.tmp", run_dir / f"{FINAL_DIR}.old")
    for d in (tmp, old):
        if d.exists():
            shutil.rmtree(d)
    save_model(model, tokenizer, tmp)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
    return final
