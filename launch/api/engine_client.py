"""The server's one view of the engine loop (engine/loop.py, whose docstring is the
contract): submit a request and await its events, abort it, the engine's health and metrics.

The loop runs in its own thread and answers through a thread-safe queue per request. Awaiting that
queue from the event loop takes a thread per waiting request, so the waits run on a dedicated pool
sized like the server's connection limit: the default executor (min(32, cores + 4) threads)
would let six slow streams starve everyone else.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dist_glm5.sampling.params import SamplingParams

log = logging.getLogger(__name__)

WAIT_SLICE_S = 0.5  # a waiting thread gives its slot back this often (a cancelled wait ends)


class EngineRefused(ValueError):
    """Refused at admission, nothing ran (e.g. longer than the context): a 400."""


class EngineFailed(RuntimeError):
    """Serving the request failed inside the engine: a 500 for this request."""


@dataclass(frozen=True)
class Output:
    """What one engine event adds to a request: new token ids, their logprobs and their text (the
    engine's incremental detokenizer: the texts concatenate to the completion); at the end the
    finish reason and the engine's final sequence (ids, usage, logprobs)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    seq: object | None = None
    logprobs: tuple[dict, ...] = ()  # the new ids' (when asked)
    prompt_logprobs: list | None = None  # once, with the first ids (when asked)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineClient:
    def __init__(self, loop, max_waiters: int = 512):
        self.loop = loop
        self._pool = ThreadPoolExecutor(max_workers=max_waiters, thread_name_prefix="engine-wait")

    @property
    def max_model_len(self) -> int:
        return self.loop.max_model_len

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[Output]:
        """Submit, then yield the request's outputs until it finishes. Leaving early (the client
        went away, the task was cancelled) aborts the request in the engine."""
        handle = self.loop.submit(prompt, params, request_id)
        finished = False
        try:
            while not finished:
                for kind, value in await self._next_events(handle):
                    if kind == "delta":
                        yield Output(
                            tuple(value.token_ids),
                            value.text,
                            logprobs=tuple(value.logprobs),
                            prompt_logprobs=value.prompt_logprobs,
                        )
                        continue
                    finished = True
                    if kind == "done":
                        yield Output((), "", value.finish_reason, value)
                    elif kind == "invalid":
                        raise EngineRefused(str(value))
                    else:  # "error"
                        raise EngineFailed(str(value))
        finally:
            if not finished:
                self.loop.abort(handle)

    async def _next_events(self, handle) -> list[tuple[str, object]]:
        """Block (on the pool) until an event arrives, then take all that are there: one hop per
        engine step however many events it produced."""
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

    def health(self):
        """EngineState: `.ok` only when the engine can serve, `.detail` why not."""
        return self.loop.health()

    def metrics(self):
        """stages.metrics.EngineMetrics, a copy taken under the loop's lock."""
        return self.loop.metrics_snapshot()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _get(q: queue.Queue, timeout: float):
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return None
