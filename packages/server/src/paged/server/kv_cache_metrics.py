"""KV block residency histograms (vLLM's --kv-cache-metrics).

    scheduler: KVCacheMetricsCollector (samples blocks at allocation)
      -> SchedulerStats.kv_cache_eviction_events (drained every stats report)
      -> PrometheusStatLogger -> KVCacheResidencyMetrics.observe()

Registered only when the option is on, as vLLM does, so a server without it
exposes no empty series. Buckets are vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Histogram

from paged.scheduler.boundary import KVCacheEvictionEvent
from paged.server.metrics_names import MetricsNaming

RESIDENCY_BUCKETS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
)
_SAMPLED = "Sampled metrics (controlled by --kv-cache-metrics-sample)."


class KVCacheResidencyMetrics:
    """The three residency histograms of one served model, in `registry`."""

    def __init__(self, registry: CollectorRegistry, naming: MetricsNaming, model_name: str) -> None:
        labels = list(naming.labelnames)
        values = naming.label_values(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                naming.name(name), f"{doc} {_SAMPLED}", labels, buckets=RESIDENCY_BUCKETS,
                registry=registry,
            )  # fmt: skip

        self.lifetime = histogram(
            "kv_block_lifetime_seconds",
            "Histogram of KV cache block lifetime from allocation to eviction.",
        ).labels(*values)
        self.idle_before_evict = histogram(
            "kv_block_idle_before_evict_seconds",
            "Histogram of idle time before KV cache block eviction.",
        ).labels(*values)
        self.reuse_gap = histogram(
            "kv_block_reuse_gap_seconds",
            "Histogram of time gaps between consecutive KV cache block accesses. "
            "Only the most recent accesses are recorded (ring buffer).",
        ).labels(*values)

    def observe(self, events: Iterable[KVCacheEvictionEvent]) -> None:
        for event in events:
            self.lifetime.observe(event.lifetime_seconds)
            self.idle_before_evict.observe(event.idle_seconds)
            for gap in event.reuse_gaps_seconds:
                self.reuse_gap.observe(gap)
