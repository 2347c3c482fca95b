"""The server's one view of the engine loop: submit a request and await its events, abort it,
ask whether the engine can serve, read its metrics.

The engine loop (launch/engine_loop.py) runs in its own thread and talks through a thread-safe
queue per request. Awaiting that queue from the event loop takes a thread per waiting request, so
the waits run on a dedicated pool sized like the server's connection limit: the default executor
(min(32, cores + 4) threads) would let six slow streams starve everyone else.

Everything this module assumes of the engine loop is in `_Engine*` helpers below, so a change in the
loop's interface changes this file only.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dist_glm5.sampling.params import SamplingParams

from .metrics import EngineMetrics

log = logging.getLogger(__name__)

WAIT_SLICE_S = 0.5  # a waiting thread re-checks for cancellation this often


class EngineRefused(ValueError):
    """The engine refused the request at admission (too long for the context, ...): a 400."""


class EngineFailed(RuntimeError):
    """Serving the request failed inside the engine (a stage failed): a 500 for this request
    only."""


@dataclass(frozen=True)
class Output:
    """What one engine event adds to a request: new token ids and the text they complete, and at
    the end the finish reason and the engine's sequence (for logprobs)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    seq: object | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineHealth:
    ok: bool
    detail: str = ""


class EngineClient:
    def __init__(self, loop, tokenizer, max_waiters: int = 256):
        self.loop = loop
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=max_waiters, thread_name_prefix="engine-wait")

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[Output]:
        """Submit and yield the request's outputs until it finishes. Leaving the iteration early
        (the client went away, the task was cancelled) aborts the request in the engine."""
        handle = self.loop.submit(prompt, params)
        text = _TextDeltas(self.tokenizer, params)
        finished = False
        try:
            while not finished:
                for kind, value in await self._next_events(handle):
                    if kind == "invalid":
                        finished = True
                        raise EngineRefused(str(value))
                    if kind == "error":
                        finished = True
                        raise EngineFailed(str(value))
                    if kind == "delta":
                        ids, delta = text.add(value)
                        if ids or delta:
                            yield Output(ids, delta)
                    elif kind == "done":
                        finished = True
                        ids, delta = text.finish(value)
                        yield Output(ids, delta, value.finish_reason, value)
        finally:
            if not finished:
                self.abort(handle)

    async def _next_events(self, handle) -> list[tuple[str, object]]:
        """Block (on the pool) until at least one event arrives, then take all that are there:
        one hop per engine step however many events it produced."""
        loop = asyncio.get_running_loop()
        first = None
        while first is None:
            first = await loop.run_in_executor(self._pool, _get, handle.events, WAIT_SLICE_S)
        events = [first]
        while True:
            try:
                events.append(handle.events.get_nowait())
            except queue.Empty:
                return events

    def abort(self, handle) -> None:
        abort = getattr(self.loop, "abort", None)
        if abort is None:
            log.warning("the engine loop has no abort(): the request runs to its end")
            return
        abort(_request_id(handle))

    def health(self) -> EngineHealth:
        health = getattr(self.loop, "health", None)
        if callable(health):
            h = health()
            ok = getattr(h, "ok", h)
            return EngineHealth(bool(ok), str(getattr(h, "detail", "") or ""))
        if not self.loop.thread.is_alive():
            return EngineHealth(False, "the engine loop has stopped")
        return EngineHealth(True)

    def metrics(self) -> EngineMetrics:
        """The engine's state now (read without a lock: counters and lengths, each read once)."""
        c = self.loop.c
        sched, stats = c.scheduler, c.stats
        blocks = getattr(sched, "block_manager", None)
        usage = getattr(blocks, "usage", 0.0) if blocks is not None else 0.0
        return EngineMetrics(
            running=len(sched.running),
            waiting=len(sched.waiting) + self.loop.inbox.qsize(),
            preemptions=getattr(sched, "num_preemptions", 0),
            cache_usage=float(usage() if callable(usage) else usage),
            steps=stats.steps,
            stage_busy_s={(k.stage, k.rank): v for k, v in dict(stats.stage_busy).items()},
            drafts_proposed=stats.drafts_proposed,
            drafts_accepted=stats.drafts_accepted,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _get(q: queue.Queue, timeout: float):
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return None


def _request_id(handle):
    """The id EngineLoop.abort takes: the handle's request id when it has one."""
    return getattr(handle, "request_id", handle)


class _TextDeltas:
    """The text of each delta: the engine's own when its events carry text. Otherwise (an engine
    loop that sends token ids only) decoded here incrementally with prefix/read offsets, so a
    partial UTF-8 character waits for its last byte and a step decodes a few tokens, not the whole
    output; text that may still become a stop string is held back until the end."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.tok = tokenizer
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""  # decoded so far
        self.sent = 0  # characters of it already given out

    def add(self, value) -> tuple[tuple[int, ...], str]:
        ids = tuple(getattr(value, "token_ids", value))
        text = getattr(value, "text", None)
        self.ids += ids
        if text is not None or self.tok is None:
            return ids, text or ""
        prev = self.tok.decode(self.ids[self.prefix : self.read])
        cur = self.tok.decode(self.ids[self.prefix :])
        if len(cur) > len(prev) and not cur.endswith("\ufffd"):
            self.text += cur[len(prev) :]
            self.prefix, self.read = self.read, len(self.ids)
        upto = max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent : upto], upto
        return ids, delta

    def finish(self, value) -> tuple[tuple[int, ...], str]:
        """The "done" event: the final text (the engine's, or decoded once from the output, whose
        stop string the coordinator has trimmed away), less what was already given out."""
        text = getattr(value, "text", None)
        out = list(value.output)
        new = tuple(out[len(self.ids) :]) if out[: len(self.ids)] == self.ids else ()
        if text is None:
            if self.tok is None:
                return new, ""
            text = self.tok.decode(out)
        return new, text[self.sent :]
