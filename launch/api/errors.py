"""Every error the server returns has OpenAI's body: {"error": {"message", "type", "param",
"code"}}.

FastAPI's 422 for a body that fails validation becomes a 400 naming the field (as vLLM does, and
as OpenAI's clients expect); a body that cannot be parsed at all (invalid UTF-8, JSON nested too
deep, a bad number) is a 400 too. Error messages never echo the raw input: it may hold a NaN or a
lone surrogate that JSON cannot encode.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .protocol import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


@dataclass
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message


class ClientGone(Exception):
    """The client closed the connection before its answer was ready (its request is aborted)."""


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    info = ErrorInfo(
        message=message,
        type=ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
        param=param,
        code=code,
    )
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status)


def _path(loc: tuple) -> tuple[str, ...]:
    """("body", "messages", 0, "content", "list[TextPart]", 0, "type") -> the request's path,
    ("messages", "0", "content", "list[TextPart]", "0", "type"), union-branch tags kept."""
    return tuple(str(p) for p in loc[1:])


def _param(path: tuple[str, ...]) -> str | None:
    """The field to name: the path up to the first union branch ("stop" for both "stop.str" and
    "stop.list[str].0"), so the field is named and not one of its alternatives."""
    head = []
    for p in path:
        if "[" in p or p in _TAGS:
            break
        head.append(p)
    return ".".join(head) or None


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid" or len(loc) <= 1:
        why = first.get("ctx", {}).get("error") or first.get("msg", "")
        return error_response(400, f"invalid JSON body: {why}")
    param = _param(_path(loc))
    why = []  # every alternative that failed for this field, as "where: what"
    for e in errors:
        path = _path(tuple(e.get("loc", ())))
        if _param(path) == param:
            where = ".".join(p for p in path if not ("[" in p or p in _TAGS))
            why.append(f"{where}: {e.get('msg', 'invalid value').removeprefix('Value error, ')}")
    why = list(dict.fromkeys(why))
    others = sorted({p for e in errors if (p := _param(_path(tuple(e["loc"])))) != param})
    more = f" (also invalid: {', '.join(others)})" if others else ""
    return error_response(400, "; ".join(why[:4]) + more, param)


def _http(_: Request, exc: HTTPException) -> JSONResponse:
    if exc.status_code == 400:  # FastAPI's "There was an error parsing the body"
        return error_response(400, f"invalid JSON body: {exc.detail}")
    return error_response(exc.status_code, str(exc.detail), code=_code(exc))


def _code(exc: HTTPException) -> str | None:
    codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
    return codes.get(exc.status_code)


def _api(_: Request, exc: ApiError) -> JSONResponse:
    response = error_response(exc.status, exc.message, exc.param, exc.code)
    if exc.status == 503:
        response.headers["Retry-After"] = "1"
    return response


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    rid = request.scope.get("request_id", "-")
    log.error("request %s: unexpected error", rid, exc_info=exc)
    # the client learns nothing of our internals; the log has the traceback under this id
    return error_response(500, f"internal server error (request id {rid}; see the server log)")


def public(message: str) -> str:
    """An engine failure's text as a client may see it: the first line, without source paths
    (gloo's `[/path/to/pair.cc:534]`) or file names, at most 300 characters."""
    line = message.strip().splitlines()[0] if message.strip() else "unknown failure"
    line = _SOURCE.sub("", line)
    line = _PATH.sub("<path>", line)
    return line[:300]


_SOURCE = re.compile(r"\[[^\]]*\.(?:cc|cpp|c|h|hpp|py|pyx)(?::\d+)?\]\s*")
_PATH = re.compile(r"(?:/[\w.+-]+){2,}")


def _gone(_: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


def install(app: FastAPI) -> None:
    app.add_exception_handler(ClientGone, _gone)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(ApiError, _api)
    app.add_exception_handler(Exception, _unexpected)
