"""A headless Chromium driven over the DevTools protocol on a pipe: no driver binary, no package.

For the browser test and the load-time benchmark of ``mosaic view``: open a page, wait until the
page says it is ready, evaluate expressions in it, click an element with real mouse events,
take a screenshot. Chromium talks JSON messages, each ended by a NUL byte, on file descriptors
3 (commands in) and 4 (replies and events out) when started with ``--remote-debugging-pipe``.

Debian: ``apt-get install -y chromium`` (the binary is ``/usr/bin/chromium``).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["Browser", "BrowserError", "find_chromium"]


class BrowserError(RuntimeError):
    """Chromium is missing, died, or answered a command with an error."""


def find_chromium() -> str | None:
    """The Chromium binary on PATH (``chromium``, ``chromium-browser``, ``google-chrome``), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None


class Browser:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self, binary: str | None = None, *, width: int = 1400, height: int = 1000, timeout: float = 60.0):
        self.binary = binary or find_chromium()
        if not self.binary:
            raise BrowserError("no chromium on PATH (Debian: apt-get install -y chromium)")
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="mosaic-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def child_fds() -> None:  # the pipe ends Chromium expects as fds 3 and 4 (copied high first: no clash)
            a, b = os.dup(cmd_r) + 100, os.dup(out_w) + 100
            os.dup2(cmd_r, a)
            os.dup2(out_w, b)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self._proc = subprocess.Popen(
            [self.binary, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--allow-file-access-from-files", f"--user-data-dir={self._profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=False, preexec_fn=child_fds)  # fmt: skip  (close_fds would close the fds made here)
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []
        target = self._send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})  # fmt: skip

    # ------------------------------------------------------------------ protocol
    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise BrowserError("chromium did not answer in time")
            chunk = os.read(self._out_r, 1 << 20)
            if not chunk:
                raise BrowserError(f"chromium closed its pipe (exit code {self._proc.poll()})")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def _send(self, method: str, params: dict | None = None, *, session: str | None = None) -> dict:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def send(self, method: str, params: dict | None = None) -> dict:
        """A DevTools command to the page; its result."""
        return self._send(method, params, session=self._session)

    # ------------------------------------------------------------------ page
    def open(self, path: str | Path, *, ready: str = "document.body && document.body.dataset.ready === '1'") -> float:
        """Navigate to a local file and wait until ``ready`` is true; returns the seconds it took."""
        url = Path(path).resolve().as_uri()
        t0 = time.perf_counter()
        self.send("Page.navigate", {"url": url})
        self.wait_for(ready)
        return time.perf_counter() - t0

    def wait_for(self, expression: str, *, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.timeout)
        while not self.eval(expression):
            if time.monotonic() > deadline:
                errors = [e for e in self.events if e.get("method") in ("Runtime.exceptionThrown",)]
                raise BrowserError(f"timed out waiting for {expression!r}; page errors: {errors[-3:]}")
            time.sleep(0.05)

    def eval(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page; a thrown exception is a BrowserError."""
        res = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in res:
            raise BrowserError(f"{expression!r} threw: {res['exceptionDetails'].get('exception', {}).get('description')}")
        return res.get("result", {}).get("value")

    def page_errors(self) -> list[str]:
        """Uncaught exceptions the page has thrown so far."""
        return [e["params"]["exceptionDetails"].get("exception", {}).get("description", "?")
                for e in self.events if e.get("method") == "Runtime.exceptionThrown"]  # fmt: skip

    def click(self, selector: str) -> None:
        """A real left click (mouse pressed and released) at the centre of the first match of ``selector``."""
        box = self.eval(f"""(() => {{ const el = document.querySelector({json.dumps(selector)});
            if (!el) return null; el.scrollIntoView({{block: 'center'}}); const r = el.getBoundingClientRect();
            return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")
        if box is None:
            raise BrowserError(f"nothing matches {selector!r}")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left",
                                                   "clickCount": 1})  # fmt: skip

    def screenshot(self, out: str | Path) -> Path:
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        out = Path(out)
        out.write_bytes(base64.b64decode(data))
        return out

    def close(self) -> None:
        try:
            self._send("Browser.close")
        except (BrowserError, OSError):
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for fd in (self._cmd_w, self._out_r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
