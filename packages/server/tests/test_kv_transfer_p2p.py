"""Server glue for P/D: the handshake's model name, and the paged:kv_transfer_* series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from paged.server.kv_transfer import kv_connector_builder
from paged.server.kv_transfer_metrics import KVTransferMetrics

CONFIG = '{"kv_connector": "PagedZmqConnector", "kv_role": "kv_consumer"}'


def test_builder_passes_the_models_last_path_component() -> None:
    # The same checkpoint sits at different paths on two hosts: they still match.
    a = kv_connector_builder(CONFIG, 16, model_name="/data/a/llama-8b/")
    b = kv_connector_builder(CONFIG, 16, model_name="/models/llama-8b")
    assert a is not None and b is not None
    assert a.model_name == b.model_name == "llama-8b"
    connector = a.make_scheduler_connector(1, 1)
    assert connector.context.model_name == "llama-8b"


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", **labels})


def test_metrics_sum_both_directions_and_the_waiting_gauge() -> None:
    registry = CollectorRegistry()
    metrics = KVTransferMetrics("m", registry)
    assert _value(registry, "paged:kv_transfer_requests_waiting") == 0
    metrics.record({"p2p.requests_waiting_for_remote_kv": 2.0, "p2p.recv_transfers": 1.0})
    metrics.record(
        {
            "p2p.requests_waiting_for_remote_kv": -1.0,
            "p2p.recv_bytes": 4096.0,
            "p2p.recv_seconds": 0.5,
            "p2p.send_transfers": 3.0,
            "p2p.send_expired": 1.0,
            "p2p.recv_failures": 1.0,
            "host.hits": 7.0,  # another connector's counter: not ours
        }
    )
    assert _value(registry, "paged:kv_transfer_requests_waiting") == 1
    assert _value(registry, "paged:kv_transfer_transfers_total", direction="recv") == 1
    assert _value(registry, "paged:kv_transfer_transfers_total", direction="send") == 3
    assert _value(registry, "paged:kv_transfer_bytes_total", direction="recv") == 4096
    assert _value(registry, "paged:kv_transfer_seconds_total", direction="recv") == 0.5
    assert _value(registry, "paged:kv_transfer_failures_total", direction="recv") == 1
    assert _value(registry, "paged:kv_transfer_expired_total") == 1
