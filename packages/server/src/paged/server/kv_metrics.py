"""Prometheus counters for KV connector stats (`SchedulerStats.kv_connector_stats`).

Connectors report flat increments, `"{tier}.{counter}"` (the OffloadingConnector:
tiers host, disk and redis). Each known counter becomes one Prometheus counter with
a `tier` label, e.g. `paged:kv_offload_hits_tokens_total{tier="disk"}`; unknown
names are ignored (a connector may report more than the server exports).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter

from paged.server.kv_transfer_metrics import KVTransferMetrics

# counter name in the stats -> (metric name, help)
_COUNTERS: dict[str, tuple[str, str]] = {
    "queries": ("paged:kv_offload_queries_tokens", "Tokens looked up in an offloading tier"),
    "hits": ("paged:kv_offload_hits_tokens", "Tokens found in an offloading tier"),
    "bytes_saved": ("paged:kv_offload_saved_bytes", "Bytes written to an offloading tier"),
    "bytes_loaded": ("paged:kv_offload_loaded_bytes", "Bytes read from an offloading tier"),
    "seconds_saved": ("paged:kv_offload_save_seconds", "Seconds spent saving to a tier"),
    "seconds_loaded": ("paged:kv_offload_load_seconds", "Seconds spent loading from a tier"),
    "evictions": ("paged:kv_offload_evictions", "Chunks evicted from an offloading tier"),
}
TIERS = ("host", "disk", "redis")
# The Redis tier's faults, `"redis.{op}_{reason}"` (connectors' redis_tier.py): each
# one a lookup or load that recomputed, or a write that was dropped.
_FAULT_OPS = ("lookup", "read", "write")


class KVConnectorMetrics:
    """Adds connector counter increments to per-tier Prometheus counters."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self._m = model_name
        self._counters = {
            name: Counter(metric, doc, ["model_name", "tier"], registry=registry)
            for name, (metric, doc) in _COUNTERS.items()
        }
        self.load_errors = Counter(
            "paged:kv_offload_load_errors",
            "Chunks that failed to load (corrupt, truncated, foreign, missing) and were recomputed",
            ["model_name"],
            registry=registry,
        )
        for counter in self._counters.values():  # export zeros so dashboards see every series
            for tier in TIERS:
                counter.labels(model_name, tier)
        self.load_errors.labels(model_name)
        self.remote_faults = Counter(
            "paged:kv_offload_remote_faults",
            "Redis tier calls that failed or were skipped (op: lookup, read, write; reason: "
            "down, timeout, oom, garbage, error, backoff, miss, corrupt, queue_full)",
            ["model_name", "tier", "op", "reason"],
            registry=registry,
        )
        self.transfer = KVTransferMetrics(model_name, registry)  # P/D (PagedZmqConnector)

    def record(self, stats: Mapping[str, float]) -> None:
        self.transfer.record(stats)
        for name, value in stats.items():
            if name == "load_errors":
                self.load_errors.labels(self._m).inc(value)
                continue
            tier, _, counter = name.partition(".")
            op, _, reason = counter.partition("_")
            if tier == "redis" and op in _FAULT_OPS and value > 0:
                self.remote_faults.labels(self._m, tier, op, reason).inc(value)
                continue
            metric = self._counters.get(counter)
            if metric is not None and tier in TIERS and value > 0:
                metric.labels(self._m, tier).inc(value)
