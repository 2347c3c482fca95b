"""/metrics through prometheus-client, one registry per server (tests start several).

Latencies are histograms observed as each request's events arrive (TTFT, inter-token, end to end);
the engine's state (queue, running, preemptions, cache usage, per-stage busy time, MTP drafts) is
read from the engine loop at scrape time by a collector, so nothing grows between scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "dist_glm5"
# vLLM's buckets, so the same dashboards read ours
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass(frozen=True)
class EngineMetrics:
    """The engine's state at one instant, as the engine client reads it."""

    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    cache_usage: float = 0.0  # fraction of KV blocks in use
    steps: int = 0
    stage_busy_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (stage, rank)
    drafts_proposed: int = 0
    drafts_accepted: int = 0


class _EngineCollector(Collector):
    def __init__(self, read: Callable[[], EngineMetrics]):
        self.read = read

    def collect(self) -> Iterator[Metric]:
        m = self.read()
        yield _gauge("num_requests_running", "Requests being generated.", m.running)
        yield _gauge("num_requests_waiting", "Requests queued for admission.", m.waiting)
        yield _counter("num_preemptions", "Sequences preempted to free KV blocks.", m.preemptions)
        yield _gauge("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.", m.cache_usage)
        yield _counter("engine_steps", "Engine steps run.", m.steps)
        busy = CounterMetricFamily(
            f"{PREFIX}_stage_busy_seconds",
            "Seconds each stage worker spent computing.",
            labels=["stage", "rank"],
        )
        for (stage, rank), s in sorted(m.stage_busy_s.items()):
            busy.add_metric([str(stage), str(rank)], s)
        yield busy
        yield _counter("mtp_draft_tokens", "MTP draft tokens proposed.", m.drafts_proposed)
        yield _counter("mtp_accepted_tokens", "MTP draft tokens accepted.", m.drafts_accepted)
        rate = m.drafts_accepted / m.drafts_proposed if m.drafts_proposed else 0.0
        yield _gauge("mtp_acceptance_ratio", "Accepted / proposed MTP drafts so far.", rate)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class ServerMetrics:
    def __init__(self, read_engine: Callable[[], EngineMetrics]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens (a step's tokens share its gap).",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Seconds from arrival to the last token.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests finished, by finish reason (stop, length, abort, error).",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens admitted.", registry=r
        )
        self.completion_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Tokens generated.", registry=r
        )
        r.register(_EngineCollector(read_engine))

    def timer(self, prompt_tokens: int) -> RequestTimer:
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTimer(self)


class RequestTimer:
    """One request's latencies, observed as its outputs arrive."""

    def __init__(self, m: ServerMetrics):
        self.m = m
        self.start = self.last = time.perf_counter()
        self.tokens = 0

    def tokens_arrived(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.tokens == 0:
            self.m.ttft.observe(now - self.start)
        else:
            gap = (now - self.last) / n  # MTP: a step brings two tokens
            for _ in range(n):
                self.m.itl.observe(gap)
        self.tokens += n
        self.last = now
        self.m.completion_tokens.inc(n)

    def finished(self, reason: str) -> None:
        self.m.requests.labels(reason).inc()
        if reason in ("stop", "length"):
            self.m.e2e.observe(time.perf_counter() - self.start)
