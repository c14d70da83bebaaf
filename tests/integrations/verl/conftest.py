"""Tests of ``mosaic.integrations.verl`` against the real verl; they run inside ``.venv-verl``.

``tests/integrations/test_verl_env.py`` builds that venv (verl 0.9.1 + ``mosaic-rl[verl,dev]``) and runs
this folder there. In any other environment (the core venv has no verl) the folder is not
collected — unless ``MOSAIC_VERL_ENV`` is set (the driver sets it), where a missing verl fails.
"""

from __future__ import annotations

import importlib.metadata
import os

def _verl_installed() -> bool:
    # not find_spec("verl"): with pytest's prepend import mode, tests/integrations is on sys.path and this
    # very folder would be found as a namespace package called ``verl``
    try:
        importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not _verl_installed():
    if os.environ.get("MOSAIC_VERL_ENV"):
        raise RuntimeError("MOSAIC_VERL_ENV is set but verl is not importable in this interpreter")
    collect_ignore_glob = ["test_*.py"]
