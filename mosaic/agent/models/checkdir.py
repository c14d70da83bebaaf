"""Is a directory a loadable model? Cheap checks before anything is loaded (issue 33).

``from_pretrained`` on a damaged directory fails deep inside transformers or safetensors, often
after minutes of other work (a warm start's evaluation, a server start). :func:`model_dir_error`
reads only metadata: ``config.json`` parses as a JSON object with a ``model_type``, the weights
files exist, every safetensors header parses and its tensors fit in the file, and a sharded
checkpoint's index names files that exist. It returns one line naming the directory, or None.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["ModelDirError", "model_dir_error", "tokenizer_dir_error"]


class ModelDirError(ValueError):
    """A model directory that cannot be loaded (message: one line naming the directory and why)."""


def _safetensors_error(f: Path) -> str | None:
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{f.name}: truncated ({size} bytes; no safetensors header)"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 1024 * 1024:
                return f"{f.name}: corrupt safetensors header (length {n} in a file of {size} bytes)"
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        return f"{f.name}: unreadable safetensors header ({exc})"
    if not isinstance(header, dict):
        return f"{f.name}: corrupt safetensors header (not a JSON object)"
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        offs = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
            return f"{f.name}: corrupt safetensors header (tensor {name!r} has no data offsets)"
        end = max(end, offs[1])
    if 8 + n + end > size:
        return f"{f.name}: truncated ({size} bytes; its header needs {8 + n + end})"
    try:  # what the loader itself checks: dtypes, shapes against offsets, every byte covered
        from safetensors import safe_open

        with safe_open(str(f), "numpy") as fh:
            fh.keys()
    except Exception as exc:  # noqa: BLE001 - SafetensorError and whatever a damaged file raises
        return f"{f.name}: corrupt safetensors header ({str(exc).splitlines()[0][:200]})"
    return None


def model_dir_error(path: str | Path) -> str | None:
    """Why ``path`` is not a loadable saved model directory, in one line naming it; None if it looks whole."""
    p = Path(path)
    if not p.is_dir():
        return f"{p}: " + ("not a directory" if p.exists() else "no such directory")
    cfg = p / "config.json"
    if not cfg.is_file():
        return f"{p}: no config.json; not a saved model directory"
    try:
        conf = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{p}: config.json does not parse ({exc})"
    if not isinstance(conf, dict) or not isinstance(conf.get("model_type"), str):
        return f"{p}: config.json has no model_type; not a transformers model config"
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{p}: model.safetensors.index.json does not parse ({exc})"
        files = [p / s for s in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            return f"{p}: weights shard(s) named in the index are missing: {', '.join(missing[:3])}"
    else:
        files = sorted(p.glob("*.safetensors"))
        if not files and not any(p.glob("*.bin")):
            return f"{p}: no weights (no *.safetensors or *.bin file)"
    for f in files:
        bad = _safetensors_error(f)
        if bad:
            return f"{p}: {bad}"
    return None


def tokenizer_dir_error(flag: str, path: str | Path) -> str | None:
    """Why ``path`` (given as ``flag``) is not a tokenizer directory a fast tokenizer loads from, in one
    line; None if it holds one (``tokenizer.json``)."""
    p = Path(path)
    if not p.is_dir():
        return f"{flag} {path}: " + ("not a directory" if p.exists() else "no such directory")
    if not (p / "tokenizer.json").is_file():
        return f"{flag} {path}: no tokenizer.json in this directory (a saved model or tokenizer directory has one)"
    return None
