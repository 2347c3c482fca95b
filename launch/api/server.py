"""uvicorn running the application: connection limits, timeouts and the listen backlog as
uvicorn's settings, the socket bound before the engine is announced ready.

A stalled or idle client holds a coroutine, not a thread; past `limit_concurrency` connections
uvicorn answers 503 at once; idle keep-alive connections close after `timeout_keep_alive`; a
request head larger than `max_header_bytes` is refused by h11.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    limit_concurrency: int = 512  # connections and tasks at once
    backlog: int = 2048  # pending connects (the kernel caps it at net.core.somaxconn)
    timeout_keep_alive: int = 15  # seconds an idle keep-alive connection stays open
    timeout_graceful_shutdown: int = 10  # seconds in-flight requests get on SIGTERM
    max_header_bytes: int = 64 << 10


class HttpServer:
    """Bind now (so the port is known, and connects queue in the backlog until serving starts),
    serve with `run()` in the main thread (uvicorn's SIGINT/SIGTERM handling) or `start()` in a
    background thread (tests)."""

    def __init__(self, app: FastAPI, settings: ServerSettings = ServerSettings()):
        self.settings = s = settings
        self.config = uvicorn.Config(
            app,
            host=s.host,
            port=s.port,
            http="h11",
            ws="none",
            lifespan="off",
            log_config=None,  # our logging configuration, not uvicorn's
            limit_concurrency=s.limit_concurrency,
            backlog=s.backlog,
            timeout_keep_alive=s.timeout_keep_alive,
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

    def start(self) -> HttpServer:
        self.thread = threading.Thread(target=self.run, name="http", daemon=True)
        self.thread.start()
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
