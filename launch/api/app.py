"""The OpenAI-compatible application: routes, the API key, error bodies, the body-size limit, the
request id.

GET /health (no key; 503 when the engine cannot serve; HEAD too), GET /v1/models and
/v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (JSON, or SSE with `stream:
true`), POST /v1/tokenize and /v1/detokenize (also under vLLM's /tokenize and /detokenize), GET
/version, GET /metrics (Prometheus), GET /openapi.json (FastAPI's schema of all of the above).
Every response carries an `X-Request-Id`: the client's, echoed, or a new one.

The event loop only moves bytes: a body is read whole by BodyLimitMiddleware (size and time
limits), then parsed, validated, tokenised and its grammar compiled on the edge threads
(serving.py), so a large or poisonous request never stalls another client's stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic.json_schema import models_json_schema
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import errors
from .auth import ApiKeyMiddleware, bearer
from .body import BodyLimitMiddleware
from .engine_client import EngineClient
from .engine_request import ModelInfo, check_chars, render_chat
from .errors import ApiError
from .limits import DEFAULT_LIMITS, Limits
from .loop_lag import LoopLag
from .metrics import registry
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    Version,
)
from .serving import Serving, parse_body, render_json

_ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 408, 413, 500)}
_SSE = {"content": {"text/event-stream": {"description": "`stream: true`: chunks, then [DONE]"}}}
_BODIES = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


def _body(model: type) -> dict:
    """The OpenAPI requestBody of a route that parses its body itself (off the event loop)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def build_app(
    engine: EngineClient,
    model: ModelInfo,
    api_key: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> FastAPI:
    lag = LoopLag()
    app = FastAPI(
        lifespan=_lifespan(lag),
        title="dist-glm5",
        summary="An OpenAI-compatible API for GLM-5 on the dist-glm5 runtime.",
        version="0.1.0",
        redoc_url=None,
        redirect_slashes=False,  # a redirect would be built from the client's Host header
    )
    errors.install(app)
    # innermost first: the key is checked before a byte of the body is read
    app.add_middleware(
        BodyLimitMiddleware, max_body_bytes=limits.max_body_bytes, body_timeout=limits.body_timeout
    )
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)  # outermost: a 401 carries the id too
    metrics = registry(engine.metrics, lag)
    serving = Serving(engine, model, limits)
    started = int(time.time())

    def card() -> ModelCard:
        return ModelCard(id=model.name, created=started, max_model_len=model.max_model_len)

    @app.head("/health", include_in_schema=False)
    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    def health():
        return _health(engine)

    api = APIRouter(dependencies=[Depends(bearer)], responses=_ERRORS)

    @api.get("/v1/models", response_model=ModelList)
    def models():
        return ModelList(data=[card()])

    @api.get("/v1/models/{model_id:path}", response_model=ModelCard)
    def retrieve_model(model_id: str):
        _check_model(model, model_id)
        return card()

    @api.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={200: _SSE},
        openapi_extra=_body(CompletionRequest),
    )
    async def completions(request: Request):
        body = await serving.off_loop(parse_body, await request.body(), CompletionRequest, limits)
        return await serving.complete(request, body)

    @api.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={200: _SSE},
        openapi_extra=_body(ChatCompletionRequest),
    )
    async def chat_completions(request: Request):
        raw = await request.body()
        body = await serving.off_loop(parse_body, raw, ChatCompletionRequest, limits)
        return await serving.chat(request, body)

    @api.post("/v1/tokenize", response_model=TokenizeResponse, openapi_extra=_body(TokenizeRequest))
    @api.post("/tokenize", response_model=TokenizeResponse, include_in_schema=False)
    async def tokenize(request: Request):
        raw = await request.body()
        return await serving.off_loop(render_json, tokenize_body, model, limits, raw)

    @api.post(
        "/v1/detokenize",
        response_model=DetokenizeResponse,
        openapi_extra=_body(DetokenizeRequest),
    )
    @api.post("/detokenize", response_model=DetokenizeResponse, include_in_schema=False)
    async def detokenize(request: Request):
        return await serving.off_loop(render_json, detokenize_body, model, await request.body())

    @api.get("/version", response_model=Version)
    def server_version():
        return Version(version=VERSION)

    @api.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    def prometheus():
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    app.include_router(api)
    app.openapi = lambda: _openapi(app)
    return app


def _lifespan(lag: LoopLag):
    """The loop-lag monitor runs while the server does."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.ensure_future(lag.run())
        yield
        task.cancel()

    return lifespan


def _health(engine: EngineClient):
    h = engine.health()
    if h.ok:
        return Health(status="ok")
    return JSONResponse(Health(status="unavailable", detail=h.detail).model_dump(), 503)


def tokenize_body(model: ModelInfo, limits: Limits, raw: bytes) -> dict:
    """/v1/tokenize: TokenizeResponse's fields as a dict (a model of millions of ids is slow to
    validate)."""
    body = parse_body(raw, TokenizeRequest, limits)
    tok = _tokenizer(model, body.model)
    if body.messages is not None:
        text = render_chat(model, body.messages, body.tools, body)
    else:
        text = body.prompt
    check_chars(text, limits, "messages" if body.messages is not None else "prompt", "the text")
    ids = tok.encode(text)
    strs = None
    if body.return_token_strs:
        texts: dict[int, str] = {}  # token id -> text, each id decoded once
        strs = [
            texts.get(t) or texts.setdefault(t, tok.decode([t], skip_special_tokens=False))
            for t in ids
        ]
    return {
        "count": len(ids),
        "max_model_len": model.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize_body(model: ModelInfo, raw: bytes) -> dict:
    body = parse_body(raw, DetokenizeRequest)
    tok = _tokenizer(model, body.model)
    bad = [t for t in body.tokens if t >= model.vocab_size]
    if bad:
        raise ApiError(
            400,
            f"tokens {bad[:5]} are outside the vocabulary 0..{model.vocab_size - 1}",
            "tokens",
        )
    return DetokenizeResponse(prompt=tok.decode(body.tokens)).model_dump()


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, plus the request bodies the routes parse themselves."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, summary=app.summary, routes=app.routes
        )
        _, defs = models_json_schema(
            [(m, "validation") for m in _BODIES], ref_template="#/components/schemas/{model}"
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


try:
    VERSION = version("dist-glm5")
except PackageNotFoundError:  # a source tree that was never installed
    VERSION = "0.0.0+unknown"


def _check_model(model: ModelInfo, name: str | None) -> None:
    if name is not None and name != model.name:
        raise ApiError(
            404,
            f"the model {name[:80]!r} does not exist; this server serves {model.name!r}",
            "model",
            "model_not_found",
        )


def _tokenizer(model: ModelInfo, name: str | None):
    _check_model(model, name)
    if model.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer")
    return model.tokenizer


class RequestIdMiddleware:
    """X-Request-Id: the client's (a printable value of at most 256 bytes), or a new one, on
    every response (an SSE stream's headers included)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k == b"x-request-id"]
        rid = given[0] if given and _printable(given[0]) else uuid.uuid4().hex.encode()
        scope["request_id"] = rid.decode("latin-1")  # a 500's body and log line name it

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = rid.decode("latin-1")
            await send(message)

        await self.app(scope, receive, send_with_id)


def _printable(v: bytes) -> bool:
    return 0 < len(v) <= 256 and all(0x20 < b < 0x7F for b in v)
