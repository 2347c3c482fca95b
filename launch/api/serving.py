"""Completions and chat completions: each API request is one engine request per choice (prompts
of a batch x n), answered as one JSON body or as server-sent events (`data: {chunk}` ...
`data: [DONE]`, chunks of the choices interleaved as they come, each naming its `index`).

The text comes from the engine's deltas (each delta's text once, never the whole output decoded
again), so the streamed chunks reassemble to exactly the non-streamed answer; logprobs ride with
the deltas of their tokens. With tools, the text goes through the GLM tool-call reader
(tool_calls.py), whole or streamed: calls become OpenAI `tool_calls` (a streamed call is one delta
when its `</tool_call>` arrives), and a choice that called a tool and stopped finishes with
"tool_calls". A client that goes away (during a stream, or while a non-streamed answer is being
generated) aborts all its requests in the engine. A refusal at admission is a 400, a failure inside
the engine a 500 for that request alone; once a stream has started, a failure arrives as an OpenAI
error event before `[DONE]`. A failure's text reaches the client without our internals
(`errors.public`); the log keeps all of it.

Off the event loop, on a few "edge" threads: parsing and validating the body, turning it into
engine requests (tokenising, compiling a grammar), and building a whole JSON answer (prompt
logprobs of a long prompt are ~20 entries per token). The loop itself only moves events and
bytes, so no request stalls another's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.sse import format_sse_event
from pydantic import BaseModel, ValidationError

from .engine_client import EngineClient, EngineFailed, EngineRefused, Output
from .engine_request import Choice, EngineRequest, ModelInfo, chat_request, completion_request
from .errors import ApiError, ClientGone, public
from .limits import DEFAULT_LIMITS, Limits
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
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from .tool_calls import ToolCallStream, parse_tool_calls

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Generation:
    """A non-streamed choice's outputs: the text's pieces (joined once: no quadratic string
    growth over a long output), and the engine's final sequence."""

    parts: list[str] = field(default_factory=list)
    seq: object | None = None
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def completion_tokens(self) -> int:
        return len(self.seq.output) if self.seq is not None else 0


@dataclass
class ChoiceStream:
    """One streamed choice's state."""

    choice: Choice
    tokens: int = 0  # so far; at the end the final sequence's (a stop string trimmed)
    offset: int = 0  # characters sent (completions' text_offset)
    started: bool = False
    tools: ToolCallStream | None = None
    called: bool = False


EDGE_THREADS = 2  # CPU-bound edge work queues here instead of fighting over the GIL
PLP_BLOCK = 256  # prompt positions rendered to JSON per call (each call holds the GIL)


LISTS = {  # request fields that are lists (or maps) -> the limit on their length
    "stop": "max_stop",
    "stop_token_ids": "max_stop_token_ids",
    "bad_words": "max_bad_words",
    "logit_bias": "max_logit_bias",
    "guided_choice": "max_guided_choice",
    "tools": "max_tools",
    "messages": "max_messages",
}


def parse_body(raw: bytes, model: type[BaseModel], limits: Limits = DEFAULT_LIMITS) -> BaseModel:
    """A JSON body validated into `model`, with FastAPI's own error shape (a 400 naming the
    field, errors.py). orjson parses (several times faster than json on a 5 MB prompt of ids);
    what it refuses, json reads, so both accept the same bodies (NaN, integers past 64 bits).
    List fields are counted against their limits before validation walks them."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:
            why = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
            err = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error"}
            raise RequestValidationError([{**err, "ctx": {"error": why}}]) from None
    if isinstance(data, dict):
        for name, limit in LISTS.items():
            if isinstance(v := data.get(name), (list, dict)):
                limits.check(name, len(v), limit)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(
            [{**x, "loc": ("body", *x["loc"])} for x in e.errors(include_url=False)]
        ) from None


class Serving:
    def __init__(self, engine: EngineClient, model: ModelInfo, limits: Limits = DEFAULT_LIMITS):
        self.engine, self.model, self.limits = engine, model, limits
        self._edge = ThreadPoolExecutor(EDGE_THREADS, thread_name_prefix="edge")

    async def off_loop(self, fn, *args):
        """fn(*args) on an edge thread: the event loop goes on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._edge, fn, *args)

    async def complete(self, request: Request, body: CompletionRequest):
        er = await self.off_loop(completion_request, body, self.model, self.limits)
        return await self._answer(request, er, _CompletionShape(self, er))

    async def chat(self, request: Request, body: ChatCompletionRequest):
        er = await self.off_loop(chat_request, body, self.model, self.limits)
        return await self._answer(request, er, _ChatShape(self, er))

    # ---- one request through the engine --------------------------------------------------------
    async def _outputs(self, c: Choice, request_id: str) -> AsyncIterator[Output]:
        try:
            gen = self.engine.generate(c.prompt, c.params, request_id)
            async with contextlib.aclosing(gen):
                async for out in gen:
                    yield out
        except EngineRefused as e:
            raise ApiError(400, str(e), None, "engine_refused") from None
        except EngineFailed as e:
            log.error("request %s failed in the engine: %s", request_id, e)
            why = public(str(e))
            raise ApiError(500, f"the engine failed serving this request: {why}") from None

    async def _answer(self, request: Request, er: EngineRequest, shape: _Shape):
        health = self.engine.health()
        if health.status in ("restarting", "dead"):  # told at once, not after the restart
            raise ApiError(
                503,
                f"the engine cannot serve now ({public(health.detail)}); retry later",
                None,
                "engine_unavailable",
            )
        choices = er.choices()
        one = len(choices) == 1
        streams = [self._outputs(c, shape.id if one else f"{shape.id}-{c.index}") for c in choices]
        if not er.stream:
            gens = await _until_disconnect(request, _all([_collect(s) for s in streams]))
            return await self.off_loop(render_json, shape.response, choices, gens)
        # the first outputs before the response starts, so a refusal is still a status code
        firsts = await _until_disconnect(request, _firsts(streams))
        return StreamingResponse(
            self._events(shape, er, choices, firsts, streams),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    async def _events(
        self,
        shape: _Shape,
        er: EngineRequest,
        choices: list[Choice],
        firsts: list[Output],
        streams: list[AsyncIterator[Output]],
    ) -> AsyncIterator[bytes]:
        states = [
            ChoiceStream(c, tools=ToolCallStream(er.tools) if er.tools else None) for c in choices
        ]
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [
            asyncio.ensure_future(_pump(i, f, s, queue))
            for i, (f, s) in enumerate(zip(firsts, streams))
        ]
        try:
            for chunk in shape.opening(choices):
                yield _sse(chunk)
            running = len(streams)
            while running:
                i, out, error = await queue.get()
                if error is not None:
                    raise error
                if out is None:
                    running -= 1
                    continue
                st = states[i]
                st.tokens = len(out.seq.output) if out.finished else st.tokens + len(out.token_ids)
                usage = None
                if er.continuous_usage:
                    usage = _usage(er.prompt_tokens, sum(s.tokens for s in states))
                if out.prompt_logprobs:  # an echoed long prompt's logprobs: off the loop
                    yield await self.off_loop(_sse_all, shape.chunks, st, out, usage)
                    continue
                for chunk in shape.chunks(st, out, usage):
                    yield _sse(chunk)
            if er.include_usage:
                yield _sse(
                    shape.usage_chunk(_usage(er.prompt_tokens, sum(s.tokens for s in states)))
                )
        except ApiError as e:
            log.error("stream %s failed: %s", shape.id, e)
            err = ErrorInfo(message=e.message, type="server_error", code=e.code)
            yield _sse(ErrorResponse(error=err))
        finally:  # a dropped stream aborts every choice still running
            for p in pumps:
                p.cancel()
            for s in streams:
                with contextlib.suppress(Exception):
                    await s.aclose()
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


async def _all(coros: list[Awaitable]) -> list:
    """Every result, in order; the first failure (or a cancel) cancels the rest (which aborts
    their engine requests)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def _firsts(streams: list[AsyncIterator[Output]]) -> list[Output]:
    try:
        return await _all([anext(s) for s in streams])
    except BaseException:
        for s in streams:  # the ones that started are aborted
            with contextlib.suppress(Exception):
                await s.aclose()
        raise


async def _pump(i: int, first: Output, stream: AsyncIterator[Output], queue: asyncio.Queue):
    """One choice's outputs into the shared queue, then (i, None, None); a failure as
    (i, None, error)."""
    try:
        out = first
        while out is not None:
            await queue.put((i, out, None))
            out = await anext(stream, None)
        await queue.put((i, None, None))
    except ApiError as e:
        await queue.put((i, None, e))
    except Exception:  # a bug: the stream ends with an error event, it never hangs
        log.exception("choice %d of a stream failed", i)
        await queue.put((i, None, ApiError(500, "internal server error (see the server log)")))


async def _until_disconnect(request: Request, work: Awaitable):
    """`work`, unless the client disconnects first: then `work` is cancelled (which aborts the
    engine requests) and ClientGone raised."""
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


def render_json(build, *args) -> Response:
    """A whole answer (the response model's dict, long parts as orjson fragments) built and
    rendered to JSON here, on an edge thread."""
    return Response(orjson.dumps(build(*args)), media_type="application/json")


def _sse_all(chunks, *args) -> bytes:
    return b"".join(_sse(c) for c in chunks(*args))


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
        self._texts: dict[int, str] = {}  # token id -> text: a long prompt repeats ids
        self._token_bytes: list[bytes] | None = None

    def tok(self, t: int) -> str:
        """A token's text as OpenAI's logprobs name it."""
        text = self._texts.get(t)
        if text is None:
            tok = self.s.model.tokenizer
            text = str(t) if tok is None else tok.decode([t], skip_special_tokens=False)
            self._texts[t] = text
        return text

    def tok_bytes(self, t: int) -> list[int]:
        tok = self.s.model.tokenizer
        if hasattr(tok, "token_bytes"):  # ours: an id may hold part of a character
            if self._token_bytes is None:
                self._token_bytes = tok.token_bytes()
            return list(self._token_bytes[t])
        return list(self.tok(t).encode("utf-8"))

    def prompt_logprobs(self, plps: list, top: int) -> orjson.Fragment:
        """Our per-position logprob dicts -> vLLM's prompt_logprobs ([null, {id: entry}...]) as
        JSON (protocol.PromptLogprobs' shape), rendered by blocks of positions: an 8K prompt's
        ~170K entries as pydantic models cost one 200+ ms call that holds the GIL."""
        parts = [b"null"]
        for i in range(0, len(plps), PLP_BLOCK):
            block = []
            for x in plps[i : i + PLP_BLOCK]:
                entry = {
                    str(t): {"logprob": v, "rank": r + 1, "decoded_token": self.tok(t)}
                    for r, (t, v) in enumerate(x["top"][:top])
                }
                entry.setdefault(
                    str(x["token"]),
                    {
                        "logprob": x["logprob"],
                        "rank": x.get("rank"),
                        "decoded_token": self.tok(x["token"]),
                    },
                )
                block.append(entry)
            parts.append(orjson.dumps(block)[1:-1])
        return orjson.Fragment(b"[" + b",".join(p for p in parts if p) + b"]")

    def opening(self, choices: list[Choice]) -> list:
        return []


class _CompletionShape(_Shape):
    prefix = "cmpl-"

    def chunks(self, st: ChoiceStream, out: Output, usage: Usage | None) -> list:
        c, er = st.choice, self.er
        text, tokens, lps, tops = "", [], [], []
        if not st.started:
            st.started = True
            if er.echo is not None:  # the prompt first, with its logprobs when asked
                text = er.echo[c.prompt_index]
                if er.logprobs is not None:
                    tokens, lps, tops = self._prompt_lp(c.prompt, out.prompt_logprobs or [])
        text += out.text
        if er.logprobs is not None:
            tokens += [self.tok(x["token"]) for x in out.logprobs]
            lps += [x["logprob"] for x in out.logprobs]
            tops += [self._top(x) for x in out.logprobs]
        chunks = []
        if text or tokens:
            lp = None
            if er.logprobs is not None:
                lp = CompletionLogprobs(
                    tokens=tokens,
                    token_logprobs=lps,
                    top_logprobs=tops,
                    text_offset=self._offsets(st.offset, tokens),
                )
            st.offset += len(text)
            chunks.append(self._chunk([CompletionChoice(index=c.index, text=text, logprobs=lp)]))
        if out.finished:
            choice = CompletionChoice(index=c.index, text="", finish_reason=out.finish_reason)
            chunks.append(self._chunk([choice], usage))
        elif chunks and usage is not None:
            chunks[-1].usage = usage
        return chunks

    def _top(self, x: dict) -> dict[str, float]:
        return {self.tok(t): v for t, v in x["top"][: self.er.logprobs]}

    def _prompt_lp(self, prompt: list[int], plps: list) -> tuple[list, list, list]:
        tokens = [self.tok(t) for t in prompt]
        lps = [None] + [x["logprob"] for x in plps]
        tops = [None] + [self._top(x) for x in plps]
        return tokens, lps, tops

    def _offsets(self, start: int, tokens: list[str]) -> list[int]:
        out = []
        for t in tokens:
            out.append(start)
            start += len(t)
        return out

    def usage_chunk(self, usage: Usage):
        return self._chunk([], usage)

    def _chunk(self, choices, usage=None):
        return CompletionChunk(
            id=self.id, created=self.created, model=self.s.model.name, choices=choices, usage=usage
        )

    def response(self, choices: list[Choice], gens: list[Generation]) -> dict:
        """CompletionResponse's JSON-ready dict."""
        er = self.er
        out, plps = [], []
        for c, g in zip(choices, gens):
            seq = g.seq
            text = g.text
            lp = None
            if er.logprobs is not None:
                tokens, lps, tops = [], [], []
                if er.echo is not None:
                    tokens, lps, tops = self._prompt_lp(c.prompt, seq.prompt_logprobs)
                tokens += [self.tok(t) for t in seq.output]
                lps += [x["logprob"] for x in seq.logprobs]
                tops += [self._top(x) for x in seq.logprobs]
                lp = CompletionLogprobs(
                    tokens=tokens,
                    token_logprobs=lps,
                    top_logprobs=tops,
                    text_offset=self._offsets(0, tokens),
                )
            if er.echo is not None:
                text = er.echo[c.prompt_index] + text
            if er.prompt_logprobs is not None:
                plps.append(self.prompt_logprobs(seq.prompt_logprobs, er.prompt_logprobs))
            out.append(
                CompletionChoice(
                    index=c.index,
                    text=text,
                    finish_reason=g.finish_reason,
                    logprobs=lp,
                    token_ids=list(seq.output),
                )
            )
        d = CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.s.model.name,
            choices=out,
            usage=_usage(er.prompt_tokens, sum(g.completion_tokens for g in gens)),
        ).model_dump(mode="json")
        for choice, plp in zip(d["choices"], plps):
            choice["prompt_logprobs"] = plp
        return d


class _ChatShape(_Shape):
    prefix = "chatcmpl-"

    def opening(self, choices: list[Choice]) -> list:
        first = [
            ChatChunkChoice(index=c.index, delta=Delta(role="assistant", content=""))
            for c in choices
        ]
        return [self._chunk(first)]

    def chunks(self, st: ChoiceStream, out: Output, usage: Usage | None) -> list:
        content, calls = out.text, []
        if st.tools is not None:
            content, calls = st.tools.feed(out.text)
            if out.finished:
                content += st.tools.finish()
            st.called = st.called or bool(calls)
        lp = self._logprobs(out.logprobs) if self.er.logprobs is not None else None
        chunks = []
        idx = st.choice.index
        if content or calls or (lp is not None and lp.content):
            delta = Delta(
                content=content or None,
                tool_calls=[ToolCallDelta(**c) for c in calls] or None,
            )
            chunks.append(self._chunk([ChatChunkChoice(index=idx, delta=delta, logprobs=lp)]))
        if out.finished:
            reason = self._reason(out.finish_reason, st.called)
            choice = ChatChunkChoice(index=idx, delta=Delta(), finish_reason=reason)
            chunks.append(self._chunk([choice], usage))
        elif chunks and usage is not None:
            chunks[-1].usage = usage
        return chunks

    @staticmethod
    def _reason(reason: str, called: bool) -> str:
        return "tool_calls" if called and reason == "stop" else reason

    def _logprobs(self, lps) -> ChatLogprobs:
        return ChatLogprobs(
            content=[
                TokenLogprob(
                    token=self.tok(x["token"]),
                    logprob=x["logprob"],
                    bytes=self.tok_bytes(x["token"]),
                    top_logprobs=[
                        TopLogprob(token=self.tok(u), logprob=v, bytes=self.tok_bytes(u))
                        for u, v in x["top"][: self.er.logprobs]
                    ],
                )
                for x in lps
            ]
        )

    def usage_chunk(self, usage: Usage):
        return self._chunk([], usage)

    def _chunk(self, choices, usage=None):
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.s.model.name, choices=choices, usage=usage
        )

    def response(self, choices: list[Choice], gens: list[Generation]) -> dict:
        """ChatCompletionResponse's JSON-ready dict."""
        er = self.er
        out = []
        for c, g in zip(choices, gens):
            content, calls = g.text, []
            if er.tools:
                content, calls = parse_tool_calls(g.text, er.tools)
            message = AssistantMessage(
                content=None if calls and not content else content,
                tool_calls=[
                    ToolCallOut(**{k: v for k, v in x.items() if k != "index"}) for x in calls
                ],
            )
            lp = self._logprobs(g.seq.logprobs) if er.logprobs is not None else None
            reason = self._reason(g.finish_reason, bool(calls))
            out.append(
                ChatChoice(index=c.index, message=message, finish_reason=reason, logprobs=lp)
            )
        d = ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.s.model.name,
            choices=out,
            usage=_usage(er.prompt_tokens, sum(g.completion_tokens for g in gens)),
        ).model_dump(mode="json")
        if er.prompt_logprobs is not None:
            d["prompt_logprobs"] = self.prompt_logprobs(
                gens[0].seq.prompt_logprobs, er.prompt_logprobs
            )
        return d
