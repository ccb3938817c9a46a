"""vLLM's `vllm:lora_requests_info` gauge (vllm/v1/metrics/loggers.py:1086-1112, 1224-1236).

Registered only with --enable-lora. Labels: `max_lora` (--max-loras),
`running_lora_adapters` and `waiting_lora_adapters` (the adapter names with
requests running / waiting, comma-separated); the value is the time of the
update, so the newest series is the current state. Under `--metrics-prefix
paged` the same gauge is `paged:lora_requests_info`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from paged.scheduler import SchedulerStats
from paged.server.metrics_names import MetricsNaming


class LoRAInfoMetric:
    def __init__(self, registry: CollectorRegistry, naming: MetricsNaming, max_loras: int) -> None:
        self.max_lora = str(max_loras)
        self.gauge = Gauge(
            naming.name("lora_requests_info"),
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=registry,
        )

    def record(self, stats: SchedulerStats) -> None:
        self.gauge.labels(
            max_lora=self.max_lora,
            waiting_lora_adapters=",".join(stats.waiting_lora_adapters),
            running_lora_adapters=",".join(stats.running_lora_adapters),
        ).set_to_current_time()
