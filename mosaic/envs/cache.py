"""The one cache directory of generated worlds, questions and search indexes.

Every verb (``mosaic data``, ``rollout``, ``train``, ``eval``, ...) resolves it the same way:
``data.cache_dir`` when set to anything but its default; else ``$MOSAIC_CACHE`` when that is set;
else ``.mosaic-cache`` in the working directory. What is cached is a pure function of its key,
so the choice of directory never changes a result, only whether it is generated again.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_CACHE_DIR = ".mosaic-cache"
"""The default of ``data.cache_dir`` (relative to the working directory)."""


def default_cache_dir() -> Path:
    """``$MOSAIC_CACHE`` if set, else ``.mosaic-cache`` in the working directory."""
    env = os.environ.get("MOSAIC_CACHE")
    return Path(env) if env else Path(DEFAULT_CACHE_DIR)


def resolve_cache_dir(configured: str | os.PathLike | None) -> Path:
    """The directory to use for a configured ``data.cache_dir`` (None or the default: :func:`default_cache_dir`)."""
    if configured is None or str(configured) in ("", DEFAULT_CACHE_DIR):
        return default_cache_dir()
    return Path(configured)


def cache_dir_error(configured: str | os.PathLike | None) -> str | None:
    """Why the resolved cache directory cannot be used (an existing file, ``/proc/x``, a read-only
    parent), in one line naming where it came from (``data.cache_dir`` or ``$MOSAIC_CACHE``); None if usable."""
    from mosaic.config.cliargs import output_error

    path = resolve_cache_dir(configured)
    from_env = (configured is None or str(configured) in ("", DEFAULT_CACHE_DIR)) and os.environ.get("MOSAIC_CACHE")
    return output_error("$MOSAIC_CACHE" if from_env else "config key 'data.cache_dir':", path, is_dir=True)
