"""Prometheus series for P/D KV transfers (`p2p.*` connector stats of PagedZmqConnector).

Worker stats arrive as flat increments `p2p.{send|recv}_{counter}`; the
decoder's scheduler side reports `p2p.requests_waiting_for_remote_kv` as a
signed delta (+1 when a request starts waiting, -1 when its pull is done),
which this class sums into a gauge.

    paged:kv_transfer_transfers_total{direction}   blocks sets sent (prefill) / received (decode)
    paged:kv_transfer_bytes_total{direction}       KV bytes moved
    paged:kv_transfer_seconds_total{direction}     time spent (decode: pull asked -> bytes in)
    paged:kv_transfer_failures_total{direction}    pulls refused / failed (timeouts, handshake)
    paged:kv_transfer_expired_total                holds freed by abort_request_timeout
    paged:kv_transfer_requests_waiting             decode requests in WAITING_FOR_REMOTE_KVS
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

DIRECTIONS = ("send", "recv")
_COUNTERS: dict[str, tuple[str, str]] = {
    "transfers": ("paged:kv_transfer_transfers", "KV block transfers between P/D engines"),
    "bytes": ("paged:kv_transfer_bytes", "KV bytes moved between P/D engines"),
    "seconds": ("paged:kv_transfer_seconds", "Seconds spent moving KV between P/D engines"),
    "failures": ("paged:kv_transfer_failures", "KV transfers that failed or were refused"),
}
WAITING_KEY = "p2p.requests_waiting_for_remote_kv"


class KVTransferMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self._m = model_name
        self._counters = {
            name: Counter(metric, doc, ["model_name", "direction"], registry=registry)
            for name, (metric, doc) in _COUNTERS.items()
        }
        self.expired = Counter(
            "paged:kv_transfer_expired",
            "Prefill requests whose held blocks were freed by abort_request_timeout",
            ["model_name"],
            registry=registry,
        )
        self.waiting = Gauge(
            "paged:kv_transfer_requests_waiting",
            "Requests waiting for remote KV (WAITING_FOR_REMOTE_KVS)",
            ["model_name"],
            registry=registry,
        )
        for counter in self._counters.values():
            for direction in DIRECTIONS:
                counter.labels(model_name, direction)
        self.expired.labels(model_name)
        self.waiting.labels(model_name).set(0)

    def record(self, stats: Mapping[str, float]) -> None:
        for name, value in stats.items():
            if not name.startswith("p2p.") or not value:
                continue
            if name == WAITING_KEY:
                self.waiting.labels(self._m).inc(value)
                continue
            direction, _, counter = name[len("p2p.") :].partition("_")
            if counter == "expired":
                self.expired.labels(self._m).inc(value)
            elif counter in self._counters and direction in DIRECTIONS and value > 0:
                self._counters[counter].labels(self._m, direction).inc(value)
