"""The API key: `Authorization: Bearer KEY` on every path but /health.

Checked in an ASGI middleware, before the body is read or parsed: a client without the key gets a
401 for any path and any body (a malformed one included), and never costs a JSON parse. The routes
also declare the bearer scheme (`bearer`), so the OpenAPI schema tells clients to send it.
"""

from __future__ import annotations

import secrets

from fastapi.security import HTTPBearer
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

OPEN_PATHS = frozenset({"/health"})
bearer = HTTPBearer(auto_error=False, description="the server's --api-key")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.expected is None
            or scope["type"] != "http"
            or scope["path"] in OPEN_PATHS
            or secrets.compare_digest(_authorization(scope), self.expected)
        ):
            return await self.app(scope, receive, send)
        response = error_response(401, "invalid or missing API key", None, "invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def _authorization(scope: Scope) -> bytes:
    values = [v for k, v in scope["headers"] if k == b"authorization"]
    return values[0] if len(values) == 1 else b""  # two Authorization headers: malformed
