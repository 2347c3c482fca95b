"""The OpenAI-compatible application: routes, the API key, error bodies, the body-size limit, the
request id.

GET /health (no key; 503 when the engine cannot serve), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (JSON, or SSE with `stream: true`), POST /v1/tokenize and
/v1/detokenize (also under vLLM's /tokenize and /detokenize), GET /version, GET /metrics
(Prometheus), GET /openapi.json (FastAPI's schema of all of the above). Every response carries an
`X-Request-Id`: the client's, echoed, or a new one.
"""

from __future__ import annotations

import time
import uuid
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import errors
from .auth import ApiKeyMiddleware, bearer
from .engine_client import EngineClient
from .engine_request import ModelInfo, render_chat
from .errors import ApiError
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
from .serving import Serving

MAX_BODY_BYTES = 32 << 20  # a 637K-token prompt as JSON token ids is ~5 MB
_ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 500)}
_SSE = {"content": {"text/event-stream": {"description": "`stream: true`: chunks, then [DONE]"}}}


def build_app(
    engine: EngineClient,
    model: ModelInfo,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    app = FastAPI(
        title="dist-glm5",
        summary="An OpenAI-compatible API for GLM-5 on the dist-glm5 runtime.",
        version="0.1.0",
        redoc_url=None,
        max_body_size=max_body_bytes,
    )
    errors.install(app)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)  # outermost: a 401 carries the id too
    metrics = registry(engine.metrics)
    serving = Serving(engine, model)
    started = int(time.time())

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    def health():
        h = engine.health()
        if h.ok:
            return Health(status="ok")
        return JSONResponse(Health(status="unavailable", detail=h.detail).model_dump(), 503)

    api = APIRouter(dependencies=[Depends(bearer)], responses=_ERRORS)

    @api.get("/v1/models", response_model=ModelList)
    def models():
        card = ModelCard(id=model.name, created=started, max_model_len=model.max_model_len)
        return ModelList(data=[card])

    @api.post("/v1/completions", response_model=CompletionResponse, responses={200: _SSE})
    async def completions(body: CompletionRequest, request: Request):
        return await serving.complete(request, body)

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={200: _SSE})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(request, body)

    @api.post("/v1/tokenize", response_model=TokenizeResponse)
    @api.post("/tokenize", response_model=TokenizeResponse, include_in_schema=False)
    def tokenize(body: TokenizeRequest):
        tok = _tokenizer(model, body.model)
        if body.messages is not None:
            text = render_chat(model, body.messages, body.tools, body)
        else:
            text = body.prompt
        ids = tok.encode(text)
        strs = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return TokenizeResponse(
            count=len(ids),
            max_model_len=model.max_model_len,
            tokens=ids,
            token_strs=strs if body.return_token_strs else None,
        )

    @api.post("/v1/detokenize", response_model=DetokenizeResponse)
    @api.post("/detokenize", response_model=DetokenizeResponse, include_in_schema=False)
    def detokenize(body: DetokenizeRequest):
        tok = _tokenizer(model, body.model)
        bad = [t for t in body.tokens if t >= model.vocab_size]
        if bad:
            raise ApiError(
                400, f"tokens {bad[:5]} are outside the vocabulary 0..{model.vocab_size - 1}",
                "tokens",
            )  # fmt: skip
        return DetokenizeResponse(prompt=tok.decode(body.tokens))

    @api.get("/version", response_model=Version)
    def server_version():
        return Version(version=VERSION)

    @api.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    def prometheus():
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    app.include_router(api)
    return app


try:
    VERSION = version("dist-glm5")
except PackageNotFoundError:  # a source tree that was never installed
    VERSION = "0.0.0+unknown"


def _tokenizer(model: ModelInfo, name: str | None):
    if name is not None and name != model.name:
        raise ApiError(
            404,
            f"the model {name!r} does not exist; this server serves {model.name!r}",
            "model",
            "model_not_found",
        )
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

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = rid.decode("latin-1")
            await send(message)

        await self.app(scope, receive, send_with_id)


def _printable(v: bytes) -> bool:
    return 0 < len(v) <= 256 and all(0x20 < b < 0x7F for b in v)
