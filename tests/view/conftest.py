"""The Chromium the browser tests drive (Debian's package, installed here if missing)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from mosaic.view.browser import find_chromium


def _apt(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def chromium() -> str:
    """Chromium from the Debian packages (``apt-get install chromium``) when it is not installed yet."""
    path = find_chromium()
    if path:
        return path
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("no chromium on PATH, and no root apt-get to install it (Debian: apt-get install -y chromium)")
    r = _apt("install", "-y", "--no-install-recommends", "chromium")
    if r.returncode != 0:  # stale package lists
        _apt("update")
        r = _apt("install", "-y", "--no-install-recommends", "chromium")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    path = find_chromium()
    assert path, "apt-get installed chromium but it is not on PATH"
    return path
