"""Run an ASGI app with uvicorn: in the foreground (``mosaic serve``, ``mosaic proxy``) or in a
background thread (in-process use and tests).

Both bind the listening socket before uvicorn starts, so ``port=0`` picks a free port and the
real one is known at once: :class:`ServerThread` exposes it as ``url``, :func:`run_server` prints
it (``... listening on http://host:port``). No "find a free port, close it, bind it again" race.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Any

import uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port=0``: any free port), not yet listening.

    Made with ``proto=IPPROTO_TCP``: asyncio turns Nagle's algorithm off (``TCP_NODELAY``) only on accepted
    sockets whose ``proto`` says TCP, and a socket made with the default ``proto=0`` (as accepted ones
    inherit it) kept Nagle on, so every response written in two pieces (headers, then body) waited for the
    client's delayed ACK: ~44 ms per request on loopback for responses under ~64 kB (0.7 ms now), paid twice
    per model call through the recording proxy."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def address_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served, as one line naming ``--port`` / ``--host``, or None.

    For the serving CLIs' argument checks, before any work: a port outside [0, 65535], or a bind
    that fails (address in use, a host that does not resolve or is not local). The trial socket
    is closed at once.
    """
    if not 0 <= port <= 65535:
        return f"--port must be in [0, 65535] (0: any free port), got {port}"
    try:
        bind(host, port).close()
    except OSError as exc:
        return f"--host {host} --port {port}: cannot bind ({exc.strerror or exc})"
    return None


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(app: Any, *, host: str, port: int, announce: str, log_level: str = "warning",
               **config: Any) -> None:
    """Serve ``app`` until SIGINT / SIGTERM (uvicorn's graceful shutdown runs the app's lifespan end).

    ``announce``: printed to stderr once the socket is bound, with ``{url}`` replaced by the real
    address, e.g. ``"mosaic serve: listening on {url}"``. ``config``: more ``uvicorn.Config`` options.
    """
    backlog = config.setdefault("backlog", 2048)
    sock = bind(host, port)
    try:
        sock.listen(backlog)  # connections made once announced wait in the backlog until uvicorn is up
        print(announce.replace("{url}", socket_url(sock)), file=sys.stderr, flush=True)
        uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", **config)).run(sockets=[sock])
    finally:
        sock.close()


class ServerThread:
    """``app`` served by uvicorn in a daemon thread; ``with ServerThread(app) as srv: ... srv.url``.

    :meth:`stop` asks uvicorn to exit gracefully, which runs the app's shutdown (the proxy flushes
    and closes its records file there; ``mosaic serve``'s app stops its model worker).
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = bind(host, port)
        self.url = socket_url(self.sock)
        self.port = self.sock.getsockname()[1]
        # A keep-alive longer than clients' idle expiry (httpx: 5 s), so a client never reuses a
        # connection the server is closing at the same moment (a POST cannot be retried safely).
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10, lifespan="on",
                                timeout_keep_alive=75, backlog=2048)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="mosaic-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"server on {self.url} exited during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
