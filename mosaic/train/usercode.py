"""Loading the user's code that a run names: ``rollout.harness`` and ``rollout.reward`` as
``module:function`` or ``path/to/file.py:function``.

A file is imported once per process while unchanged, under its own module name, with its folder
appended to ``sys.path`` (last: installed packages win over files beside it). Anything that goes
wrong while importing — an exception, an exit at import time — is one error naming the config key.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

from mosaic.config.sections import CALLABLE_SPEC, ConfigError

__all__ = ["is_callable_spec", "load_callable", "check_callables"]


def is_callable_spec(spec: str) -> bool:
    """``module:function`` or ``path/to/file.py:function`` (a Python callable) rather than a shell command."""
    return bool(CALLABLE_SPEC.match(spec.strip()))


_FILE_MODULES: dict[tuple[Path, int], object] = {}  # (path, mtime_ns) -> module: a file's top-level code runs once


def _load_file(path: Path):
    """Import a ``.py`` file as module ``mosaic_harness_<stem>``; the same unchanged file is imported once per
    process (the config check and the trainer both load the harness). Its folder is appended to
    ``sys.path`` — last, so installed packages win over files beside it (a harness named ``openai.py`` can
    still ``import openai``) while its own helper modules can be imported."""
    key = (path, path.stat().st_mtime_ns)
    if key not in _FILE_MODULES:
        if str(path.parent) not in sys.path:
            sys.path.append(str(path.parent))
        name = f"mosaic_harness_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # registered while it runs, as an import would (dataclasses look it up)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _FILE_MODULES[key] = module
    return _FILE_MODULES[key]


def load_callable(spec: str, what: str) -> Callable:
    """Import ``module:function``; a clear ValueError naming ``what`` when it cannot be."""
    mod, _, name = spec.strip().rpartition(":")
    try:
        if mod.endswith(".py"):  # a file: imported under its own name, its folder last on sys.path
            path = Path(mod).resolve()
            if not path.is_file():
                raise ImportError(f"no file {mod}")
            module = _load_file(path)
        else:
            module = importlib.import_module(mod)
        fn = getattr(module, name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - whatever importing the user's module raises (an exit
        # at import time included), said in one line naming the key
        raise ValueError(f"{what}: cannot load {spec!r}: {type(exc).__name__}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"{what}: {spec!r} is not callable")
    return fn


def check_callables(rc) -> None:
    """Load ``rollout.harness`` and ``rollout.reward`` when they name Python callables: a
    :class:`ConfigError` naming the key if one cannot be (before the warm start and its evaluation)."""
    for spec, what in ((rc.harness, "rollout.harness"), (rc.reward, "rollout.reward")):
        if spec and is_callable_spec(spec):
            try:
                load_callable(spec, what)
            except ValueError as exc:
                raise ConfigError(f"config key '{what}': {str(exc).removeprefix(what + ': ')}") from None
