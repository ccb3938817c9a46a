"""paged-only counters of multimodal encoder work (EPD: who encodes, who loads).

    paged:mm_encoder_items_computed_total   items sent to this engine's vision encoder
                                            (0 on an EPD consumer)
    paged:ec_connector_loaded_items_total   items whose embeddings came through the EC connector
    paged:ec_connector_released_items_total producer: outputs freed after a consumer's ACK
                                            or hold_timeout

vLLM has no such metrics, so they exist only under paged's naming (`paged:`);
with `--metrics-prefix vllm` the registry holds vLLM's names alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter

from paged.scheduler import SchedulerStats


class EncoderItemMetrics:
    def __init__(self, registry: CollectorRegistry, labelnames: Sequence[str]) -> None:
        labels = list(labelnames)
        self.computed = Counter(
            "paged:mm_encoder_items_computed",
            "Multimodal items sent to this engine's vision encoder",
            labels,
            registry=registry,
        )
        self.loaded = Counter(
            "paged:ec_connector_loaded_items",
            "Multimodal items whose embeddings were loaded by the EC connector",
            labels,
            registry=registry,
        )
        self.released = Counter(
            "paged:ec_connector_released_items",
            "Encoder outputs an EC producer freed (acknowledged by a consumer, or expired)",
            labels,
            registry=registry,
        )

    def record(self, stats: SchedulerStats, label_values: Sequence[str]) -> None:
        self.computed.labels(*label_values).inc(stats.num_encoder_items_computed)
        self.loaded.labels(*label_values).inc(stats.num_encoder_items_loaded)
        self.released.labels(*label_values).inc(stats.num_encoder_items_released)
