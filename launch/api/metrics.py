"""/metrics through prometheus-client: the engine loop's bounded metrics (engine/metrics.py),
read as one snapshot at each scrape and exported under vLLM's names with our prefix.

The engine keeps the histograms (TTFT, inter-token, end-to-end, queue time) as fixed buckets, so
nothing grows between scrapes and the server observes nothing itself. One registry per app (tests
start several servers in one process).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from dist_glm5.engine.metrics import EngineMetrics, Histogram

from .loop_lag import LoopLag

PREFIX = "dist_glm5"


class EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineMetrics], lag: LoopLag | None = None):
        self.snapshot, self.lag = snapshot, lag

    def collect(self) -> Iterator[Metric]:
        if self.lag is not None:
            yield _histogram(
                "event_loop_lag_seconds", "How late the server's event loop woke.", self.lag.hist
            )
            yield _gauge(
                "event_loop_lag_max_seconds", "The worst loop lag since start.", self.lag.worst
            )
        m = self.snapshot()
        yield _histogram("time_to_first_token_seconds", "Submit to first token.", m.ttft)
        yield _histogram(
            "inter_token_latency_seconds",
            "Between a request's token deliveries (an MTP step's two tokens are one).",
            m.itl,
        )
        yield _histogram("e2e_request_latency_seconds", "Submit to finish.", m.e2e)
        yield _histogram("request_queue_time_seconds", "Submit to first scheduled.", m.queue)

        done = CounterMetricFamily(
            f"{PREFIX}_request_success", "Requests finished, by reason.", labels=["finished_reason"]
        )
        for reason, n in sorted(m.finished.items()):
            done.add_metric([reason], n)
        yield done
        yield _counter("requests_invalid", "Requests refused at admission.", m.invalid)
        yield _counter("prompt_tokens", "Prompt tokens admitted.", m.prompt_tokens)
        yield _counter("generation_tokens", "Tokens generated.", m.generation_tokens)
        yield _counter("num_preemptions", "Sequences preempted to free KV blocks.", m.preemptions)
        yield _counter(
            "pipeline_restarts", "Pipeline restarts after a failure.", m.pipeline_restarts
        )
        yield _counter("engine_steps", "Engine steps.", m.steps)
        yield _counter("mtp_draft_tokens", "MTP draft tokens proposed.", m.mtp_drafts)
        yield _counter("mtp_accepted_tokens", "MTP draft tokens accepted.", m.mtp_accepted)
        busy = CounterMetricFamily(
            f"{PREFIX}_stage_busy_seconds",
            "Seconds each stage worker spent computing.",
            labels=["stage", "rank"],
        )
        for (stage, rank), s in sorted(m.stage_busy_seconds.items()):
            busy.add_metric([str(stage), str(rank)], s)
        yield busy

        yield _gauge("num_requests_running", "Requests generating.", m.running)
        yield _gauge("num_requests_waiting", "Requests in the scheduler's queue.", m.waiting)
        yield _gauge("num_requests_preempted", "Preempted, waiting to recompute.", m.preempted)
        yield _gauge("queue_length", "Submitted and not yet running.", m.queue_length)
        yield _gauge("kv_cache_usage_ratio", "Fraction of KV-cache blocks held.", m.cache_usage)
        yield _gauge("kv_cache_blocks", "KV-cache blocks per worker.", m.cache_blocks)
        rate = m.mtp_acceptance
        yield _gauge("mtp_acceptance_ratio", "Accepted / proposed MTP drafts.", rate or 0.0)


def _histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
    buckets = [(_le(b), n) for b, n in h.cumulative()]
    return HistogramMetricFamily(f"{PREFIX}_{name}", doc, buckets=buckets, sum_value=h.sum)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def registry(
    snapshot: Callable[[], EngineMetrics], lag: LoopLag | None = None
) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(EngineCollector(snapshot, lag))
    return r
