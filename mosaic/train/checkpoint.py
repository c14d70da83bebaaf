"""Atomic checkpoints and resume.

A checkpoint is a directory ``<run_dir>/checkpoints/ckpt-<step>/`` holding
- ``model/``: weights as safetensors (``save_pretrained`` for HF models, a plain
  ``model.safetensors`` for other modules) and the tokenizer when given;
- ``optimizer.pt``, ``scheduler.pt``: their ``state_dict`` s;
- ``rng.pt``: python, numpy, torch CPU and CUDA RNG states and every named
  generator passed in (``torch.Generator`` or ``numpy.random.Generator``);
- ``trainer_state.json``: step and free-form JSON state (data cursor, ...);
- ``COMPLETE``: a manifest (every file and its size), written last.

Atomicity: everything is written into ``ckpt-<step>.tmp/``, each file fsynced,
the manifest written, the directory renamed to ``ckpt-<step>/`` (an atomic
rename on POSIX), the parent fsynced, and only then the ``latest`` pointer file
replaced atomically (write ``latest.tmp``, fsync, ``os.replace``). A kill at any
moment leaves either the old state or the new one: ``*.tmp`` directories and
directories whose manifest is missing or does not match the files on disk are
ignored by :func:`find_latest`, which falls back to the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from safetensors.torch import save_file
from safetensors.torch import load_file

__all__ = ["CheckpointState", "save_checkpoint", "load_checkpoint", "find_latest", "list_checkpoints",
           "is_complete", "resolve_resume", "capture_rng", "restore_rng"]  # fmt: skip

MANIFEST = "COMPLETE"
LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d+)$")


@dataclass
class CheckpointState:
    """What :func:`load_checkpoint` returns besides restoring objects in place."""

    path: Path
    step: int
    state: dict[str, Any] = field(default_factory=dict)
    """The free-form JSON state saved with the checkpoint (data cursor, counters, ...)."""


# --------------------------------------------------------------------------------------
# Durable file helpers.


def _fsync_file(p: Path) -> None:
    with open(p, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(p: Path, text: str) -> None:
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    _fsync_dir(p.parent)


def _manifest(d: Path) -> dict[str, int]:
    return {str(f.relative_to(d)): f.stat().st_size for f in sorted(d.rglob("*")) if f.is_file() and f.name != MANIFEST}


# --------------------------------------------------------------------------------------
# RNG state.


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


# --------------------------------------------------------------------------------------
# Model weights.


def _save_model(model, tokenizer, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(d, safe_serialization=True)
    else:

        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(d)


def _load_model(model, d: Path) -> None:

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint model dir {d} has no .safetensors file")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = getattr(model, "_tied_weights_keys", None) or {}
    tied = set(tied) if not isinstance(tied, dict) else set(tied)
    # Weights tied to another parameter are not saved by save_pretrained; nothing else may be missing.
    bad_missing = [k for k in missing if k not in tied]
    if bad_missing or unexpected:
        raise RuntimeError(f"checkpoint {d}: missing weights {bad_missing[:5]}, unexpected {list(unexpected)[:5]}")


# --------------------------------------------------------------------------------------
# Save / find / load.


def _ckpt_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_complete(d: Path) -> bool:
    """True when ``d`` has a manifest matching its files (names and sizes)."""
    m = d / MANIFEST
    if not d.is_dir() or not _NAME.match(d.name) or not m.is_file():
        return False
    try:
        want = json.loads(m.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return want == _manifest(d)


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, ascending by step."""
    root = _ckpt_root(run_dir)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _NAME.match(d.name)
        if m and is_complete(d):
            out.append((int(m.group(1)), d))
    return sorted(out)


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint: the ``latest`` pointer if it names one, else a scan."""
    root = _ckpt_root(run_dir)
    ptr = root / LATEST
    if ptr.is_file():
        d = root / ptr.read_text().strip()
        if is_complete(d):
            return d
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model=None,
    tokenizer=None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    generators: Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
    keep_last: int = 2,
) -> Path:
    """Write ``ckpt-<step>`` atomically, move ``latest`` to it, prune to ``keep_last`` complete ones."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = _ckpt_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("ckpt-*.tmp"):  # left by a killed save
        shutil.rmtree(stale, ignore_errors=True)
    name = f"ckpt-{int(step)}"
    tmp = root / f"{name}.tmp"
    tmp.mkdir()
    if model is not None:
        _save_model(model, tokenizer, tmp / "model")
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(capture_rng(generators), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": int(step), "state": dict(state or {})}, indent=1))
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync_file(f)
    with open(tmp / MANIFEST, "w") as f:
        json.dump({"step": int(step), "files": _manifest(tmp)}, f)
        f.flush()
        os.fsync(f.fileno())
    for d in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
        _fsync_dir(d)
    final = root / name
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
        old = root / f"{name}.old.tmp"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / LATEST, name)
    for s, d in list_checkpoints(run_dir)[:-keep_last]:
        if d != final:
            shutil.rmtree(d, ignore_errors=True)
    return final


def load_checkpoint(
    path: str | Path,
    *,
    model=None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    generators: Mapping[str, Any] | None = None,
    restore_rngs: bool = True,
    map_location: str | torch.device = "cpu",
) -> CheckpointState:
    """Restore the given objects in place from a complete checkpoint; return step and state."""
    d = Path(path)
    if not is_complete(d):
        raise FileNotFoundError(f"{d} is not a complete checkpoint (no or mismatching {MANIFEST} manifest)")
    if model is not None:
        _load_model(model, d / "model")
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(d / "optimizer.pt", map_location=map_location, weights_only=True))
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(d / "scheduler.pt", weights_only=True))
    if restore_rngs:
        restore_rng(torch.load(d / "rng.pt", weights_only=True), generators)
    meta = json.loads((d / "trainer_state.json").read_text())
    return CheckpointState(path=d, step=int(meta["step"]), state=meta.get("state", {}))


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """``train.resume`` → the checkpoint to load: ``never`` → None; ``auto`` → the run dir's
    latest complete one (None if none); otherwise a path that must be a complete checkpoint."""
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(run_dir)
    p = Path(resume)
    if p.is_dir() and not _NAME.match(p.name):  # a run dir: its latest
        found = find_latest(p)
        if found is None:
            raise FileNotFoundError(f"train.resume={resume!r}: no complete checkpoint under that run dir")
        return found
    if not is_complete(p):
        raise FileNotFoundError(f"train.resume={resume!r} is not a complete checkpoint")
    return p
