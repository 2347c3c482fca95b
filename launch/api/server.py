"""uvicorn running the application: the connection limits and timeouts (launch/api/limits.py,
enforced by connections.py's protocol), the listen backlog, the socket bound before the engine
is announced ready.

A stalled or idle client holds a coroutine, not a thread. A connection must send its request head
within `header_timeout` (or `keep_alive_timeout` after a response); past `max_connections` the
longest-idle connection is closed to make room, so idle sockets are shed before /health or a
request in flight notices. A request head larger than `max_header_bytes` is refused by h11.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI

from .connections import Stats, guarded_protocol
from .limits import Limits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    limits: Limits = field(default_factory=Limits)
    backlog: int = 2048  # pending connects (the kernel caps it at net.core.somaxconn)
    timeout_graceful_shutdown: int = 10  # seconds in-flight requests get on SIGTERM
    max_header_bytes: int = 64 << 10


class HttpServer:
    """Bind now (so the port is known, and connects queue in the backlog until serving starts),
    serve with `run()` in the main thread (uvicorn's SIGINT/SIGTERM handling) or `start()` in a
    background thread (tests)."""

    def __init__(self, app: FastAPI, settings: ServerSettings = ServerSettings()):
        self.settings = s = settings
        self.stats = Stats()
        self.config = uvicorn.Config(
            app,
            host=s.host,
            port=s.port,
            http=guarded_protocol(s.limits, self.stats),
            ws="none",
            lifespan="on",  # the app's loop-lag monitor starts and stops with it
            log_config=None,  # our logging configuration, not uvicorn's
            limit_concurrency=None,  # the protocol sheds idle connections instead of 503s
            backlog=s.backlog,
            timeout_keep_alive=max(1, int(s.limits.keep_alive_timeout)),
            timeout_graceful_shutdown=s.timeout_graceful_shutdown,
            h11_max_incomplete_event_size=s.max_header_bytes,
        )
        self.server = uvicorn.Server(self.config)
        self.sock = _listen(s.host, s.port, s.backlog)
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self, timeout: float = 10.0) -> HttpServer:
        """Serve from a background thread; returns once uvicorn has started (its lifespan ran)."""
        self.thread = threading.Thread(target=self.run, name="http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock
