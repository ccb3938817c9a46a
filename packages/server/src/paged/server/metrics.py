"""Prometheus metrics (vLLM's names under the `paged:` prefix, or vLLM's own).

`PrometheusStatLogger` owns its own `CollectorRegistry` (no global state, so
several engines or tests never collide); the API serves
`generate_latest(logger.registry)` at `/metrics`. `naming` picks the prefix,
labels and buckets (`metrics_names.py`): `paged:` by default, or exactly
vLLM's `vllm:` metrics for vLLM's dashboards and routers.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from paged.scheduler import SchedulerStats
from paged.server.epd_metrics import EncoderItemMetrics
from paged.server.kv_cache_metrics import KVCacheResidencyMetrics
from paged.server.kv_metrics import KVConnectorMetrics
from paged.server.lora_metrics import LoRAInfoMetric
from paged.server.metrics_names import PAGED_NAMING, MetricsNaming
from paged.server.pooling_metrics import PoolingMetrics
from paged.server.spec_metrics import SpecDecodingMetrics
from paged.server.stats import IterationStats

FINISH_REASONS = ("stop", "length", "abort", "error")


class StatLogger(Protocol):
    """Receives the engine's scheduler stats and the frontend's iteration stats."""

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None: ...


@runtime_checkable
class PerEngineStatLogger(Protocol):
    """A `StatLogger` that labels what it records with the engine it came from.

    `AsyncLLM` calls `record_engine` with each output batch's `engine_index`
    (data parallelism: one frontend, several engine cores).
    """

    def record_engine(
        self,
        engine_index: int,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
    ) -> None: ...


class PrometheusStatLogger:
    """Engine and request metrics for one served model.

    `num_engines > 1` (data parallelism): every engine metric carries the
    `engine` label ("0", "1", ... as vLLM's do) under either naming scheme,
    and each engine's gauges show that engine's own scheduler.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        naming: MetricsNaming = PAGED_NAMING,
        *,
        kv_cache_metrics: bool = False,
        kv_connector_metrics: bool = False,
        num_speculative_tokens: int = 0,
        num_engines: int = 1,
        max_loras: int | None = None,
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if num_engines > 1 and not naming.engine_label:
            naming = dataclasses.replace(naming, engine_label=True)
        self.num_engines = num_engines
        self.registry = registry if registry is not None else CollectorRegistry()
        # Residency histograms exist only with --kv-cache-metrics (as in vLLM).
        self.kv_residency = (
            KVCacheResidencyMetrics(self.registry, naming, model_name) if kv_cache_metrics else None
        )
        labels = list(naming.labelnames)
        r = self.registry
        n = naming.name
        self.running = Gauge(
            n("num_requests_running"), "Requests running on the engine", labels, registry=r
        )
        self.waiting = Gauge(
            n("num_requests_waiting"), "Requests waiting to be scheduled", labels, registry=r
        )
        self.kv_usage = Gauge(
            n("kv_cache_usage_perc"), "KV cache usage (1 = full)", labels, registry=r
        )
        # paged-only (EPD): who encodes, who loads; absent under vLLM's naming.
        self.encoder_items = (
            EncoderItemMetrics(r, labels) if naming.prefix == PAGED_NAMING.prefix else None
        )
        self.prefix_queries = Counter(
            n("prefix_cache_queries"), "Prefix-cache queries, in tokens", labels, registry=r
        )
        self.prefix_hits = Counter(
            n("prefix_cache_hits"), "Prefix-cache hits, in tokens", labels, registry=r
        )
        self.preemptions = Counter(n("num_preemptions"), "Preempted requests", labels, registry=r)
        self.prompt_tokens = Counter(
            n("prompt_tokens"), "Prefilled prompt tokens", labels, registry=r
        )
        self.generation_tokens = Counter(
            n("generation_tokens"), "Generated tokens", labels, registry=r
        )
        self.request_success = Counter(
            n("request_success"),
            "Finished requests by finish reason",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            n("time_to_first_token_seconds"),
            "Time to first token",
            labels,
            buckets=naming.ttft_buckets,
            registry=r,
        )
        self.itl = Histogram(
            n("inter_token_latency_seconds"),
            "Inter-token latency",
            labels,
            buckets=naming.itl_buckets,
            registry=r,
        )
        self.e2e = Histogram(
            n("e2e_request_latency_seconds"),
            "End-to-end request latency",
            labels,
            buckets=naming.e2e_buckets,
            registry=r,
        )
        # paged's own (vLLM has no such metric), so it keeps its name under any scheme.
        self.http_requests = Counter(
            "paged:http_requests",
            "API requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        # paged-only: pooling requests apart from generation; absent under vLLM's naming,
        # whose exposition stays exactly vLLM's (which has no pooling metric).
        self.pooling = (
            PoolingMetrics(r, model_name) if naming.prefix == PAGED_NAMING.prefix else None
        )
        # Every engine metric's label values: (model_name,) or vLLM's (model_name, engine);
        # always `.labels(*self._lv)`, never the model name alone.
        self._lv = naming.label_values(model_name)
        self._engine_lv = [naming.label_values(model_name, i) for i in range(num_engines)]
        # paged's own per-tier connector counters keep the paged: names (vLLM has none);
        # registered only when a KV connector is configured, so other servers show none.
        self.kv_connector = KVConnectorMetrics(model_name, r) if kv_connector_metrics else None
        # vLLM's spec_decode_* counters, registered only with speculative decoding on.
        self.spec_decoding = (
            SpecDecodingMetrics(r, naming, self._lv, num_speculative_tokens)
            if num_speculative_tokens > 0
            else None
        )
        # vLLM's lora_requests_info, registered only with --enable-lora (max_loras set).
        self.lora_info = LoRAInfoMetric(r, naming, max_loras) if max_loras is not None else None
        for lv in self._engine_lv:
            for reason in FINISH_REASONS:  # export zeros so dashboards see every series
                self.request_success.labels(*lv, reason)

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        self.record_engine(0, scheduler_stats, iteration_stats)

    def record_engine(
        self,
        engine_index: int,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
    ) -> None:
        """Record under engine `engine_index`'s labels (ValueError outside 0..num_engines-1)."""
        if not 0 <= engine_index < self.num_engines:
            raise ValueError(f"engine_index must be in [0, {self.num_engines}), got {engine_index}")
        m = self._engine_lv[engine_index]
        if scheduler_stats is not None:
            s = scheduler_stats
            self.running.labels(*m).set(s.num_running_reqs)
            self.waiting.labels(*m).set(s.num_waiting_reqs)
            self.kv_usage.labels(*m).set(s.kv_cache_usage)
            self.prefix_queries.labels(*m).inc(s.prefix_cache_stats.queries)
            self.prefix_hits.labels(*m).inc(s.prefix_cache_stats.hits)
            self.preemptions.labels(*m).inc(s.num_preempted_reqs)
            if self.encoder_items is not None:
                self.encoder_items.record(s, m)
            if self.kv_residency is not None:
                self.kv_residency.observe(s.kv_cache_eviction_events)
            if self.kv_connector is not None:
                self.kv_connector.record(s.kv_connector_stats)
            if self.spec_decoding is not None and s.spec_decoding_stats is not None:
                self.spec_decoding.record(s.spec_decoding_stats)
            if self.lora_info is not None:
                self.lora_info.record(s)
        if iteration_stats is not None:
            it = iteration_stats
            self.prompt_tokens.labels(*m).inc(it.num_prompt_tokens)
            self.generation_tokens.labels(*m).inc(it.num_generation_tokens)
            for t in it.time_to_first_tokens:
                self.ttft.labels(*m).observe(t)
            for t in it.inter_token_latencies:
                self.itl.labels(*m).observe(t)
            for f in it.finished_requests:
                self.request_success.labels(*m, str(f.finish_reason)).inc()
                self.e2e.labels(*m).observe(f.e2e_latency)
