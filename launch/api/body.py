"""A request body read whole, within a size and a time limit, before any route sees it.

ASGI middleware: a declared Content-Length over `max_body_bytes` is a 413 before a byte of the
body is read; a body that grows past it is a 413 as soon as it does; a body that has not arrived
within `body_timeout` (a client that sends its head and then stalls) is a 408. Chunks are kept
in a list and joined once (linear in the body). The route then reads the same body from a replay,
and later `receive()` calls (a disconnect) go to the client again.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_body_bytes, body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._too_large(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout)
        except asyncio.TimeoutError:
            response = error_response(
                408,
                f"the request body did not arrive within {self.timeout:g}s (--body-timeout)",
                None,
                "body_timeout",
            )
            response.headers["Connection"] = "close"
            return await response(scope, receive, send)
        if body is None:
            return await self._too_large(scope, receive, send)
        if body is _GONE:
            return None  # the client left before its body arrived: nothing to answer
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive):
        """The whole body; None once it is over the limit; _GONE if the client left."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _GONE
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
            None,
            "body_too_large",
        )
        response.headers["Connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)


_GONE = object()  # the client left before its body arrived (compared with `is`)


def _content_length(scope: Scope) -> int | None:
    for k, v in scope["headers"]:
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None
