"""The event loop's own lag, measured inside the server: a task asks to wake every `interval` and
records how late it woke. Anything that holds the loop (or the GIL, from another thread) for long
shows here, whatever the client sees; /metrics exports it as `dist_glm5_event_loop_lag_seconds`
(and the worst since start as a gauge), which `bench probe-server` reads around each poison."""

from __future__ import annotations

import asyncio
import time

from dist_glm5.engine.metrics import Histogram

BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopLag:
    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.hist = Histogram(BOUNDS)
        self.worst = 0.0

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.interval)
            lag = max(0.0, time.monotonic() - t - self.interval)
            self.hist.observe(lag)
            self.worst = max(self.worst, lag)
