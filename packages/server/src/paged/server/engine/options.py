"""User-facing engine options -> `EngineCore` keyword arguments.

    --async-scheduling          -> batch_queue_size=2   (vLLM: two batches in flight)
    --kv-cache-metrics [-sample R] -> kv_cache_metrics_sample=R (None: no collector)

Kept apart from `EngineArgs` so that the mapping (and its validation, which
names the option) is one small function both `LLM` and `paged serve` call.
"""

from __future__ import annotations

from typing import Any

# vLLM's depth with async scheduling: step N+1 is scheduled while N runs.
ASYNC_SCHEDULING_BATCH_QUEUE_SIZE = 2


def engine_core_options(
    *, async_scheduling: bool, kv_cache_metrics: bool, kv_cache_metrics_sample: float
) -> dict[str, Any]:
    """`EngineCore` kwargs for these options; `ValueError` naming a bad one."""
    # vLLM's check (0, 1]: a zero rate would register histograms that never fill.
    if not 0.0 < kv_cache_metrics_sample <= 1.0:
        raise ValueError(
            f"kv_cache_metrics_sample must be in (0, 1], got {kv_cache_metrics_sample}"
        )
    return {
        "batch_queue_size": ASYNC_SCHEDULING_BATCH_QUEUE_SIZE if async_scheduling else 1,
        "kv_cache_metrics_sample": kv_cache_metrics_sample if kv_cache_metrics else None,
    }
