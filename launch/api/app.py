"""The OpenAI-compatible application: routes, the API key, error bodies, the body-size limit.

GET /health (no key; 503 when the engine cannot serve), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (JSON, or SSE with `stream: true`), GET /metrics (Prometheus),
GET /openapi.json (FastAPI's schema of all of the above).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import errors
from .auth import ApiKeyMiddleware, bearer
from .engine_client import EngineClient
from .engine_request import ModelInfo
from .metrics import registry
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
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

    @api.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    def prometheus():
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    app.include_router(api)
    return app
