"""Run an ASGI app with uvicorn in a background thread (tests, benchmarks, embedding the proxy).

The socket is bound before the server starts (port 0 picks a free port), so
``url`` is known and valid as soon as :meth:`ServerThread.start` returns.
:meth:`ServerThread.stop` asks uvicorn to exit gracefully, which runs the
app's shutdown (the proxy flushes and closes its records file there).
"""

from __future__ import annotations

import socket
import threading
import time


class ServerThread:
    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        # A keep-alive longer than clients' idle expiry (httpx: 5 s), so a client never reuses a
        # connection the server is closing at the same moment (a POST cannot be retried safely).
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10, lifespan="on",
                                timeout_keep_alive=75, backlog=2048)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server thread exited during start-up")
            if time.time() > deadline:
                raise RuntimeError(f"server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
