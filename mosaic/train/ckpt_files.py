"""The files of a checkpoint: durable writes (fsync, atomic replace) and integrity (a manifest of every
file's size and sha256, written last; :func:`verify_checkpoint` says what is wrong with a directory).
The checkpoint layout and the save / load / resume logic are :mod:`mosaic.train.checkpoint`'s."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch

__all__ = ["MANIFEST", "CKPT_NAME", "fsync_file", "fsync_dir", "write_atomic", "manifest_sizes", "sha256_file",
           "read_manifest", "inside", "is_complete", "structure_problem", "verify_checkpoint"]

MANIFEST = "COMPLETE"
CKPT_NAME = re.compile(r"^ckpt-(\d+)$")


def fsync_file(p: Path) -> None:
    with open(p, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(p: Path, text: str) -> None:
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    fsync_dir(p.parent)


def manifest_sizes(d: Path) -> dict[str, int]:
    return {str(f.relative_to(d)): f.stat().st_size for f in sorted(d.rglob("*")) if f.is_file() and f.name != MANIFEST}


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(d: Path) -> dict[str, Any] | None:
    try:
        m = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or not isinstance(m.get("files"), dict):
        return None
    return m


def inside(p: Path, root: Path) -> bool:
    """``p`` (symlinks resolved) is ``root`` itself or below it."""
    try:
        p.resolve().relative_to(root.resolve())
    except (ValueError, OSError, RuntimeError):
        return False
    return True


def is_complete(d: Path) -> bool:
    """True when ``d`` has a manifest matching its files (names and sizes; cheap, no hashing)."""
    if not d.is_dir() or not CKPT_NAME.match(d.name) or not (d / MANIFEST).is_file():
        return False
    m = read_manifest(d)
    return m is not None and m["files"] == manifest_sizes(d)


def structure_problem(f: Path) -> str | None:
    """Why a weights / state file cannot be read (parsed, not hashed), or None."""
    if f.suffix == ".safetensors":
        try:
            with open(f, "rb") as fh:
                raw = fh.read(8)
                (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
                size = f.stat().st_size
                if n < 2 or 8 + n > size:
                    return f"corrupt safetensors header in {f.name} (header length {n}, file {size} bytes)"
                header = json.loads(fh.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            if not isinstance(header, dict) or 8 + n + end != size:
                return f"corrupt safetensors header in {f.name} (tensor data does not match the file size)"
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error) as exc:
            return f"corrupt safetensors header in {f.name} ({type(exc).__name__}: {exc})"[:300]
    elif f.suffix == ".pt":
        try:
            torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 — any unpickling failure means "corrupt"
            return f"corrupt {f.name} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"[:300]
    return None


def verify_checkpoint(d: str | Path) -> str | None:
    """None when ``d`` is a complete, intact checkpoint; otherwise the reason it is not.

    Checks the manifest against the files on disk (missing, unexpected, resized files), no file is
    a symlink leading out of the checkpoint, every file's sha256 (manifests written before hashes
    existed: the safetensors headers are parsed and the ``*.pt`` files loaded instead), and names
    the first problem: ``missing file …``, ``corrupt safetensors header in …``, ``corrupt optimizer.pt
    …``, ``sha256 mismatch in …``."""
    d = Path(d)
    if not d.is_dir():
        return "not a directory" if not d.exists() else "not a directory (a file)"
    if not CKPT_NAME.match(d.name):
        return f"not a checkpoint directory name (want ckpt-<step>, got {d.name!r})"
    if not (d / MANIFEST).is_file():
        return f"no {MANIFEST} manifest (unfinished write?)"
    m = read_manifest(d)
    if m is None:
        return f"unreadable {MANIFEST} manifest"
    want: dict[str, Any] = m["files"]
    have = manifest_sizes(d)
    missing = sorted(set(want) - set(have))
    if missing:
        return f"missing file {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    extra = sorted(set(have) - set(want))
    if extra:
        return f"file {extra[0]} is not in the manifest"
    for name in sorted(want):
        f = d / name
        if f.is_symlink() or not inside(f, d):
            return f"{name} is a symlink (refused: checkpoint files must be plain files)"
        if have[name] != want[name]:
            return f"size mismatch in {name} ({have[name]} bytes, manifest says {want[name]}; truncated?)"
    hashes = m.get("sha256")
    for name in sorted(want):
        f = d / name
        if isinstance(hashes, dict) and name in hashes:
            if sha256_file(f) != hashes[name]:
                return structure_problem(f) or f"sha256 mismatch in {name} (content changed after it was saved)"
        elif f.suffix in (".safetensors", ".pt"):  # a manifest from before content hashes
            why = structure_problem(f)
            if why:
                return why
    return None
