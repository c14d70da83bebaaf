"""Small from-scratch causal LMs (Llama or Qwen2 layout) sized for CPU tests and training.

The model's vocabulary comes from the project tokenizer, so ids never need a
mapping: ``vocab_size = len(tokenizer)`` and the pad / eos / bos ids are read from
the tokenizer's special tokens. Weights are fp32 (bf16 is ~25x slower on the
CPUs this project targets; cast on GPU if you want).

Saving and loading go through ``save_pretrained`` / ``from_pretrained`` on a local
directory (safetensors). The tokenizer is saved by :func:`mosaic.agent.tokenizer.save_tokenizer`,
so the directory loads with ``AutoTokenizer`` / ``AutoModelForCausalLM`` with the same ids
(checked at save time). :func:`load_model` reads it as ``PreTrainedTokenizerFast`` (what
``tokenizer.json`` defines, for directories saved before that too) and checks that a probe
string gives the ids recorded at save time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from mosaic.agent.tokenizer import CHECK_FILE as _CHECK_FILE
from mosaic.agent.tokenizer import save_tokenizer
from mosaic.agent.models.checkdir import ModelDirError, model_dir_error

Arch = Literal["llama", "qwen2"]


@dataclass(frozen=True)
class EmbeddedModelConfig:
    """Shape of a small decoder-only transformer; the vocabulary comes from the tokenizer."""

    arch: Arch = "qwen2"
    """``qwen2`` (bias on q/k/v projections) or ``llama`` (no biases)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of decoder blocks."""
    num_heads: int = 4
    """Query heads; must divide ``hidden_size``."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    intermediate_size: int = 384
    """Hidden width of the gated MLP."""
    max_positions: int = 2048
    """Longest context (RoPE table length); the harness's context budget must fit."""
    tie_embeddings: bool = True
    """Share input embedding and output head weights (saves ``vocab * hidden`` params)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    initializer_range: float = 0.02
    """Std of the normal weight init."""

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"arch: expected 'llama' or 'qwen2', got {self.arch!r}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("hidden_size / num_heads (head dim) must be even for RoPE")

    @classmethod
    def preset(cls, name: str, **overrides) -> "EmbeddedModelConfig":
        """A named preset (``tiny``, ``cpu``), optionally with fields overridden."""
        try:
            base = PRESETS[name]
        except KeyError:
            raise ValueError(f"preset: unknown {name!r}; known: {sorted(PRESETS)}") from None
        return replace(base, **overrides)

    def num_parameters(self, vocab_size: int) -> int:
        """Parameter count for a given vocabulary (what ``build_model`` will produce)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        kv = self.num_kv_heads * (h // self.num_heads)
        attn = h * h * 2 + h * kv * 2  # q, o, k, v
        if self.arch == "qwen2":
            attn += h + 2 * kv  # q/k/v biases
        per_layer = attn + 3 * h * i + 2 * h  # gated MLP + two RMSNorms
        emb = vocab_size * h * (1 if self.tie_embeddings else 2)
        return L * per_layer + emb + h


PRESETS: dict[str, EmbeddedModelConfig] = {
    # ~1.3M parameters at a 4096-token vocabulary: unit tests, seconds on CPU.
    "tiny": EmbeddedModelConfig(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                                intermediate_size=384),
    # ~5.8M parameters at a 4096-token vocabulary: the CPU training preset.
    "cpu": EmbeddedModelConfig(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4,
                               intermediate_size=768),
}


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int, int | None]:
    """(pad, eos, bos) ids; eos is required (it ends a turn), pad falls back to eos."""
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if eos is None or eos == tokenizer.unk_token_id:
            raise ValueError("tokenizer: no eos token (expected <|im_end|>)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return pad, eos, tokenizer.bos_token_id


def _hf_config(config: EmbeddedModelConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    pad, eos, bos = _special_ids(tokenizer)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        initializer_range=config.initializer_range,
        pad_token_id=pad,
        eos_token_id=eos,
        bos_token_id=bos,
        dtype="float32",
    )
    if config.arch == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(**common)


def build_model(config: EmbeddedModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int,
                ) -> PreTrainedModel:
    """A freshly initialised fp32 causal LM over ``tokenizer``'s vocabulary, deterministic in ``seed``."""
    hf_config = _hf_config(config, tokenizer)
    # Seed a local generator via the global RNG state, restored afterwards so the
    # caller's random stream is not disturbed.
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.pad_token_id = hf_config.pad_token_id
    model.generation_config.eos_token_id = hf_config.eos_token_id
    model.generation_config.bos_token_id = hf_config.bos_token_id
    model.config.mosaic_embedded = asdict(config)
    return model.eval()


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str | Path,
               ) -> Path:
    """Write weights (safetensors), config and tokenizer to ``directory``; returns it.

    The tokenizer is checked to load back with ``AutoTokenizer`` to the same ids
    (:func:`mosaic.agent.tokenizer.save_tokenizer`).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)  # after the model: AutoTokenizer reads config.json
    return out


def load_tokenizer_checked(directory: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved in ``directory``, verified to produce the ids recorded at save time."""
    path = Path(directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    check_file = path / _CHECK_FILE
    if check_file.exists():
        check = json.loads(check_file.read_text())
        ids = tokenizer(check["text"], add_special_tokens=False)["input_ids"]
        if ids != check["ids"] or len(tokenizer) != check["vocab_size"]:
            raise ValueError(
                f"{path}: the reloaded tokenizer does not reproduce the ids recorded at save "
                "time (different pre-tokenisation or vocabulary); refusing to load")
    return tokenizer


def load_model(directory: str | Path, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load ``(model, tokenizer)`` saved by :func:`save_model` (local files only, eval mode)."""
    path = Path(directory)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json; not a saved model directory")
    bad = model_dir_error(path)
    if bad:
        raise ModelDirError(bad)
    try:
        tokenizer = load_tokenizer_checked(path)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:  # what the metadata check cannot see
        raise ModelDirError(f"{path}: cannot be loaded ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]})") from exc
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise ValueError(
            f"{path}: model vocabulary {model.get_input_embeddings().num_embeddings} is smaller "
            f"than the tokenizer's {len(tokenizer)}")
    return model.to(device).eval(), tokenizer
