"""Per-process step profiler: named spans (off by default, free when off).

Spans nest; the anatomy of a step uses exclusive times (a span minus the spans inside it), so the
parts add up to the step. Categories: experts, router+shared (MoE work outside the expert kernels),
attention, indexer, mlp (dense), all_reduce, transfer, recv_wait (pipeline bubble), sampler, and
the rest of the step as host.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class Profiler:
    def __init__(self) -> None:
        self.enabled = False
        self.events: list[tuple[str, float, float, int]] = []  # name, start s, duration s, depth
        self._depth = 0

    @contextmanager
    def span(self, name: str):
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self.events.append((name, t0, time.perf_counter() - t0, self._depth))

    def take(self) -> list[tuple[str, float, float, int]]:
        ev, self.events = self.events, []
        return ev


PROF = Profiler()


def exclusive_times(events: list[tuple[str, float, float, int]]) -> dict[str, float]:
    """Seconds per span name with nested spans subtracted (events of one step, any order)."""
    ev = sorted(events, key=lambda e: (e[1], e[3]))
    out: dict[str, float] = {}
    for i, (name, t0, dur, depth) in enumerate(ev):
        inner = sum(d for n, s, d, dep in ev if dep == depth + 1 and s >= t0 and s + d <= t0 + dur + 1e-9)
        out[name] = out.get(name, 0.0) + dur - inner
    return out
