"""Bounded engine metrics in plain Python (no torch, no prometheus here): counters, gauges and
fixed-bucket histograms. The engine loop owns one `EngineMetrics`; the HTTP server exports a
snapshot (`EngineLoop.metrics_snapshot()`) through prometheus-client. Nothing here grows with the
number of requests: a histogram is its bucket counts, a sum and a count.

Suggested Prometheus names (prefix dist_glm5_, vLLM's where vLLM has one):
- histograms: time_to_first_token_seconds (ttft), inter_token_latency_seconds (itl),
  e2e_request_latency_seconds (e2e), request_queue_time_seconds (queue)
- counters: request_success_total{finished_reason} (finished), prompt_tokens_total,
  generation_tokens_total, num_preemptions_total (preemptions), pipeline_restarts_total,
  engine_steps_total (steps), mtp_draft_tokens_total / mtp_accepted_tokens_total,
  stage_busy_seconds_total{stage,rank}, requests_invalid_total
- gauges: num_requests_running, num_requests_waiting, num_requests_preempted (waiting to be
  recomputed), queue_length (submitted, not yet running), kv_cache_usage_ratio (cache_usage),
  kv_cache_blocks_total, mtp_acceptance_ratio
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_left
from dataclasses import dataclass, field

# vLLM's buckets, so the same dashboards read ours
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


@dataclass
class Histogram:
    """Fixed buckets: counts[i] observations <= bounds[i] (and > bounds[i-1]); counts[-1] the ones
    above every bound (+Inf). Not cumulative: `cumulative()` gives Prometheus' form."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(self.bounds):
            raise ValueError(f"histogram bounds must ascend, got {self.bounds}")
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, v: float) -> None:
        if not math.isfinite(v):
            return
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper bound, observations <= it)], ending with (inf, count)."""
        out, n = [], 0
        for b, c in zip((*self.bounds, math.inf), self.counts):
            n += c
            out.append((b, n))
        return out


@dataclass
class EngineMetrics:
    # counters: only ever grow
    finished: dict[str, int] = field(
        default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0}
    )  # requests by finish reason
    invalid: int = 0  # refused at admission
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    pipeline_restarts: int = 0
    steps: int = 0
    mtp_drafts: int = 0
    mtp_accepted: int = 0
    stage_busy_seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (stage, rank)
    # gauges: the state now
    running: int = 0
    waiting: int = 0  # in the scheduler's queue (the preempted included)
    preempted: int = 0  # waiting to be recomputed after a preemption
    queue_length: int = 0  # submitted and not yet running (waiting + not yet admitted)
    cache_usage: float = 0.0  # fraction of KV blocks held
    cache_blocks: int = 0
    # histograms (seconds)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))  # per delta event
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))  # submit -> running

    @property
    def mtp_acceptance(self) -> float | None:
        return self.mtp_accepted / self.mtp_drafts if self.mtp_drafts else None

    def snapshot(self) -> EngineMetrics:
        return copy.deepcopy(self)
