"""Random-number state of a run (python, numpy, torch CPU/CUDA and named generators), saved with each
checkpoint so a resumed run draws exactly what an uninterrupted one would."""

from __future__ import annotations

import json
import random
from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Python, numpy (global), torch CPU/CUDA and the named generators' states."""
    np_state = np.random.get_state(legacy=False)
    out: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"], "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},  # fmt: skip
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": {},
    }
    for name, g in (generators or {}).items():
        if isinstance(g, torch.Generator):
            out["generators"][name] = {"torch": g.get_state()}
        elif isinstance(g, np.random.Generator):
            out["generators"][name] = {"numpy": json.dumps(g.bit_generator.state)}
        else:
            raise TypeError(f"generator {name!r}: expected torch.Generator or numpy.random.Generator, got {type(g)}")
    return out


def restore_rng(state: dict[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    """Inverse of :func:`capture_rng`; every named generator must be in ``state``."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"], "state": {"key": n["key"].numpy().astype(np.uint32),
                         "pos": n["pos"]}, "has_gauss": n["has_gauss"], "gauss": n["gauss"]})  # fmt: skip
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, g in (generators or {}).items():
        if name not in state["generators"]:
            raise KeyError(f"checkpoint has no state for generator {name!r} (has {sorted(state['generators'])})")
        s = state["generators"][name]
        if isinstance(g, torch.Generator):
            g.set_state(s["torch"])
        else:
            g.bit_generator.state = json.loads(s["numpy"])
