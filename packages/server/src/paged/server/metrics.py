"""Prometheus metrics (vLLM's names under the `paged:` prefix).

`PrometheusStatLogger` owns its own `CollectorRegistry` (no global state, so
several engines or tests never collide); the API serves
`generate_latest(logger.registry)` at `/metrics`.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from paged.scheduler import SchedulerStats
from paged.server.kv_metrics import KVConnectorMetrics
from paged.server.stats import IterationStats

_LATENCY_BUCKETS = (
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
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
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
    10.0,
)
FINISH_REASONS = ("stop", "length", "abort", "error")


class StatLogger(Protocol):
    """Receives the engine's scheduler stats and the frontend's iteration stats."""

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None: ...


class PrometheusStatLogger:
    """Engine and request metrics for one served model."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge(
            "paged:num_requests_running", "Requests running on the engine", labels, registry=r
        )
        self.waiting = Gauge(
            "paged:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r
        )
        self.kv_usage = Gauge(
            "paged:kv_cache_usage_perc", "KV cache usage (1 = full)", labels, registry=r
        )
        self.prefix_queries = Counter(
            "paged:prefix_cache_queries", "Prefix-cache queries, in tokens", labels, registry=r
        )
        self.prefix_hits = Counter(
            "paged:prefix_cache_hits", "Prefix-cache hits, in tokens", labels, registry=r
        )
        self.preemptions = Counter(
            "paged:num_preemptions", "Preempted requests", labels, registry=r
        )
        self.prompt_tokens = Counter(
            "paged:prompt_tokens", "Prefilled prompt tokens", labels, registry=r
        )
        self.generation_tokens = Counter(
            "paged:generation_tokens", "Generated tokens", labels, registry=r
        )
        self.request_success = Counter(
            "paged:request_success",
            "Finished requests by finish reason",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "paged:time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "paged:inter_token_latency_seconds",
            "Inter-token latency",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "paged:e2e_request_latency_seconds",
            "End-to-end request latency",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.http_requests = Counter(
            "paged:http_requests",
            "API requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.kv_connector = KVConnectorMetrics(model_name, r)
        self._m = model_name
        for reason in FINISH_REASONS:  # export zeros so dashboards see every series
            self.request_success.labels(model_name, reason)

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        m = self._m
        if scheduler_stats is not None:
            s = scheduler_stats
            self.running.labels(m).set(s.num_running_reqs)
            self.waiting.labels(m).set(s.num_waiting_reqs)
            self.kv_usage.labels(m).set(s.kv_cache_usage)
            self.prefix_queries.labels(m).inc(s.prefix_cache_stats.queries)
            self.prefix_hits.labels(m).inc(s.prefix_cache_stats.hits)
            self.preemptions.labels(m).inc(s.num_preempted_reqs)
            self.kv_connector.record(s.kv_connector_stats)
        if iteration_stats is not None:
            it = iteration_stats
            self.prompt_tokens.labels(m).inc(it.num_prompt_tokens)
            self.generation_tokens.labels(m).inc(it.num_generation_tokens)
            for t in it.time_to_first_tokens:
                self.ttft.labels(m).observe(t)
            for t in it.inter_token_latencies:
                self.itl.labels(m).observe(t)
            for f in it.finished_requests:
                self.request_success.labels(m, str(f.finish_reason)).inc()
                self.e2e.labels(m).observe(f.e2e_latency)
