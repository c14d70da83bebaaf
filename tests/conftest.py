"""Fixtures shared by every test folder: servers run as subprocesses, and an address that refuses."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from mosaic.serving import bind

_ANNOUNCE = re.compile(r"listening on (http://\S+)")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def peers():
    """``bench/_peers.py`` (peer libraries in virtualenvs of their own), loaded by path."""
    spec = importlib.util.spec_from_file_location("mosaic_bench_peers", REPO / "bench" / "_peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def refused_url():
    """``http://127.0.0.1:PORT`` where connections are refused: the port is held bound, never listened on."""
    sock = bind("127.0.0.1", 0)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.fixture
def spawn_server():
    """``spawn(cmd, health_path, env=None) -> (proc, url)``: run a server command given ``--port 0``,
    read the address it announces (``... listening on URL``, see :mod:`mosaic.serving`) from its
    output, and wait until ``url + health_path`` answers. Processes still running at the end are killed."""
    procs: list[subprocess.Popen] = []

    def spawn(cmd: list[str], health_path: str, env: dict | None = None, timeout: float = 120.0):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(proc)
        seen = []
        for line in iter(proc.stdout.readline, b""):
            seen.append(line.decode(errors="replace"))
            m = _ANNOUNCE.search(seen[-1])
            if m:
                break
        else:
            proc.wait(30)
            pytest.fail(f"{cmd[:6]} exited ({proc.returncode}) without announcing its address:\n{''.join(seen)[-3000:]}")
        url = m.group(1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(url + health_path, timeout=5).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{cmd[:6]} did not answer on {url + health_path}: {proc.stdout.read().decode()[-3000:]}")
            time.sleep(0.1)

    yield spawn
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        if p.stdout and not p.stdout.closed:
            p.stdout.close()
