"""uvicorn's h11 protocol with what it lacks against idle and slow sockets.

uvicorn closes an idle keep-alive connection only after a response, and its keep-alive timer is
reset by any byte: a socket that never sends a request, or sends its head a byte at a time
(slowloris), stays open forever, and its `limit_concurrency` then answers every new request,
/health included, with a 503. This subclass adds (the one thing we add over uvicorn):
- a head deadline: a request's head must arrive within `header_timeout` of the connection
  opening or of the previous response (bytes do not extend it); then the socket is closed (a 408
  if it had sent part of a head);
- a connection cap that sheds the idle first: past `max_connections`, the connection that has
  waited longest for a request head is closed, never one with a request in flight; only when
  every connection is busy is the new one refused (503);
- OpenAI's JSON body on the few answers uvicorn writes itself (a malformed request's 400).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import Limits

log = logging.getLogger(__name__)


def raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with OpenAI's error body, for answers written to the socket
    outside any request (no ASGI app runs)."""
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class Stats:
    """Counters the probe and the log read: connections closed for each reason."""

    def __init__(self) -> None:
        self.head_timeouts = 0
        self.evicted = 0
        self.refused = 0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's protocol with a head deadline and a connection cap; `guarded_protocol` binds it
    to its limits and counters."""

    limits: Limits = Limits()
    stats: Stats = Stats()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._waiting_since = time.monotonic()
        self._head_bytes = 0
        self._arm_head_timer(self.limits.header_timeout)
        if len(self.connections) > self.limits.max_connections:
            self._shed()

    # ---- the head deadline -------------------------------------------------------------
    def _arm_head_timer(self, seconds: float) -> None:
        self._disarm_head_timer()
        self._waiting_since, self._head_bytes = time.monotonic(), 0
        self._head_timer = self.loop.call_later(seconds, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    @property
    def waiting_for_head(self) -> bool:
        return self._head_timer is not None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        self.stats.head_timeouts += 1
        if self._head_bytes:  # part of a head: tell it why (nginx's 408)
            msg = "no complete request head in time (--header-timeout, --keep-alive-timeout)"
            self.transport.write(raw_error(408, "Request Timeout", msg, "header_timeout"))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if self.waiting_for_head:
            self._head_bytes += len(data)
        super().data_received(data)
        c = self.cycle
        if c is not cycle and c is not None and not c.response_complete:  # a head is in
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # kept alive: the next head, within its timeout
            self._arm_head_timer(self.limits.keep_alive_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    # ---- the connection cap ------------------------------------------------------------
    def _shed(self) -> None:
        """Close the connection that has waited longest for a head (never this new one while
        an older one waits); with none waiting, refuse this one."""
        idle = [c for c in self.connections if getattr(c, "waiting_for_head", False)]
        oldest = min(idle, key=lambda c: c._waiting_since, default=self)
        if oldest is not self:
            self.stats.evicted += 1
            oldest._disarm_head_timer()
            oldest.transport.close()
            return
        self.stats.refused += 1
        log.warning("%d connections open, none idle: refusing a new one", len(self.connections))
        msg = f"the server has {self.limits.max_connections} connections open; retry later"
        self.transport.write(raw_error(503, "Service Unavailable", msg, "too_many_connections"))
        self._disarm_head_timer()
        self.transport.close()

    # ---- uvicorn's own answers in OpenAI's shape ---------------------------------------
    def send_400_response(self, msg: str) -> None:
        self.transport.write(raw_error(400, "Bad Request", msg, "invalid_http_request"))
        self.transport.close()


def guarded_protocol(limits: Limits, stats: Stats) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...), bound to these limits and counters."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "stats": stats})
