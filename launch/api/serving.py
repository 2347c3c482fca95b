"""Completions and chat completions: one engine request each, answered as one JSON body or as
server-sent events (`data: {chunk}` ... `data: [DONE]`).

The text comes from the engine's deltas (each delta's text once, never the whole output decoded
again), so the streamed chunks reassemble to exactly the non-streamed answer. A client that goes
away (during a stream, or while a non-streamed answer is being generated) aborts its request in
the engine. A refusal at admission is a 400, a failure inside the engine a 500 for that request
alone; once a stream has started, a failure arrives as an OpenAI error event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse
from fastapi.sse import format_sse_event

from .engine_client import EngineClient, EngineFailed, EngineRefused, Output
from .engine_request import EngineRequest, ModelInfo, chat_request, completion_request
from .errors import ApiError, ClientGone
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ErrorInfo,
    ErrorResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
)

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Generation:
    """A non-streamed request's outputs: the text's pieces (joined once: no quadratic string
    growth over a long output), and the engine's final sequence."""

    parts: list[str] = field(default_factory=list)
    seq: object | None = None
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def usage(self, prompt_tokens: int) -> Usage:
        return _usage(prompt_tokens, len(self.seq.output) if self.seq is not None else 0)


class Serving:
    def __init__(self, engine: EngineClient, model: ModelInfo):
        self.engine, self.model = engine, model

    async def complete(self, request: Request, body: CompletionRequest):
        er = completion_request(body, self.model)
        return await self._answer(request, er, _CompletionShape(self, er))

    async def chat(self, request: Request, body: ChatCompletionRequest):
        er = chat_request(body, self.model)
        return await self._answer(request, er, _ChatShape(self, er))

    # ---- one request through the engine --------------------------------------------------------
    async def _outputs(self, er: EngineRequest, request_id: str) -> AsyncIterator[Output]:
        try:
            async for out in self.engine.generate(er.prompt, er.params, request_id):
                yield out
        except EngineRefused as e:
            raise ApiError(400, str(e), None, "engine_refused") from None
        except EngineFailed as e:
            raise ApiError(500, f"the engine failed serving this request: {e}") from None

    async def _answer(self, request: Request, er: EngineRequest, shape: _Shape):
        outputs = self._outputs(er, shape.id)
        if not er.stream:
            g = await _until_disconnect(request, _collect(outputs))
            return shape.response(g)
        # the first output before the response starts, so a refusal is still a status code
        first = await _until_disconnect(request, anext(outputs))
        return StreamingResponse(
            self._events(shape, er, first, outputs),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    async def _events(
        self, shape: _Shape, er: EngineRequest, first: Output, outputs: AsyncIterator[Output]
    ) -> AsyncIterator[bytes]:
        prompt_tokens = len(er.prompt)
        async with contextlib.aclosing(outputs):  # a dropped stream aborts the request
            try:
                for chunk in shape.opening():
                    yield _sse(chunk)
                out: Output | None = first
                n = 0  # tokens so far; at the end the final sequence's (a stop string trimmed)
                while out is not None:
                    n = len(out.seq.output) if out.finished else n + len(out.token_ids)
                    usage = _usage(prompt_tokens, n) if er.continuous_usage else None
                    if out.text:
                        yield _sse(shape.chunk(out.text, None, usage))
                    if out.finished:
                        yield _sse(shape.chunk(None, out.finish_reason, usage))
                    out = await anext(outputs, None)
                if er.include_usage:
                    yield _sse(shape.usage_chunk(_usage(prompt_tokens, n)))
            except ApiError as e:
                log.error("stream %s failed: %s", shape.id, e)
                err = ErrorInfo(message=e.message, type="server_error", code=e.code)
                yield _sse(ErrorResponse(error=err))
        yield DONE


# ---- helpers -----------------------------------------------------------------------------------


async def _collect(outputs: AsyncIterator[Output]) -> Generation:
    g = Generation()
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            g.parts.append(out.text)
            if out.finished:
                g.seq, g.finish_reason = out.seq, out.finish_reason
    return g


async def _until_disconnect(request: Request, work: Awaitable):
    """`work`, unless the client disconnects first: then `work` is cancelled (which aborts the
    engine request) and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down: the work goes too
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(model) -> bytes:
    return format_sse_event(data_str=model.model_dump_json())


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


# ---- response shapes: what differs between the two endpoints ------------------------------------


class _Shape:
    prefix = ""

    def __init__(self, s: Serving, er: EngineRequest):
        self.s, self.er = s, er
        self.id = self.prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _tok(self, t: int) -> str:
        tok = self.s.model.tokenizer
        return tok.decode([t]) if tok is not None else str(t)

    def opening(self) -> list:
        return []


class _CompletionShape(_Shape):
    prefix = "cmpl-"

    def chunk(self, text: str | None, finish: str | None, usage: Usage | None):
        choice = CompletionChoice(text=text or "", finish_reason=finish, logprobs=None)
        return self._chunk([choice], usage)

    def usage_chunk(self, usage: Usage):
        return self._chunk([], usage)

    def _chunk(self, choices, usage):
        return CompletionChunk(
            id=self.id, created=self.created, model=self.s.model.name, choices=choices, usage=usage
        )

    def response(self, g: Generation) -> CompletionResponse:
        seq, p = g.seq, self.er.params
        lp = None
        if p.logprobs is not None:
            lp = CompletionLogprobs(
                tokens=[self._tok(t) for t in seq.output],
                token_logprobs=[x["logprob"] for x in seq.logprobs],
                top_logprobs=[{self._tok(t): v for t, v in x["top"]} for x in seq.logprobs],
            )
        choice = CompletionChoice(
            text=g.text,
            finish_reason=g.finish_reason,
            logprobs=lp,
            token_ids=list(seq.output),
            prompt_logprobs=[None, *seq.prompt_logprobs] if p.prompt_logprobs is not None else None,
        )
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.s.model.name,
            choices=[choice],
            usage=g.usage(len(self.er.prompt)),
        )


class _ChatShape(_Shape):
    prefix = "chatcmpl-"

    def opening(self) -> list:
        return [self._chunk([ChatChunkChoice(delta=Delta(role="assistant", content=""))], None)]

    def chunk(self, text: str | None, finish: str | None, usage: Usage | None):
        delta = Delta(content=text) if text is not None else Delta()
        return self._chunk([ChatChunkChoice(delta=delta, finish_reason=finish)], usage)

    def usage_chunk(self, usage: Usage):
        return self._chunk([], usage)

    def _chunk(self, choices, usage):
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.s.model.name, choices=choices, usage=usage
        )

    def response(self, g: Generation) -> ChatCompletionResponse:
        seq, p = g.seq, self.er.params
        lp = None
        if p.logprobs is not None:
            lp = ChatLogprobs(
                content=[
                    TokenLogprob(
                        token=self._tok(t),
                        logprob=x["logprob"],
                        top_logprobs=[
                            TopLogprob(token=self._tok(u), logprob=v) for u, v in x["top"]
                        ],
                    )
                    for t, x in zip(seq.output, seq.logprobs)
                ]
            )
        choice = ChatChoice(
            message=AssistantMessage(content=g.text), finish_reason=g.finish_reason, logprobs=lp
        )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.s.model.name,
            choices=[choice],
            usage=g.usage(len(self.er.prompt)),
        )
