"""Models the agent runs locally: small from-scratch LMs (:mod:`.embedded`) and SmolLM2 (:mod:`.smollm2`)."""

from __future__ import annotations

from pathlib import Path

SMOLLM2 = "smollm2"


def load_any(spec: str, *, device: str = "cpu"):
    """``(model, tokenizer)`` from ``spec``: ``"smollm2"`` or a directory written by ``save_model``."""
    # lazy: torch and transformers take seconds; `mosaic --help` and `mosaic rollout --policy expert` need neither
    if spec == SMOLLM2:
        from mosaic.agent.models.smollm2 import load_smollm2

        return load_smollm2(device=device)
    if not Path(spec).is_dir():
        raise FileNotFoundError(f"--model {spec!r}: neither '{SMOLLM2}' nor an existing directory")
    from mosaic.agent.models.embedded import load_model

    return load_model(spec, device=device)
