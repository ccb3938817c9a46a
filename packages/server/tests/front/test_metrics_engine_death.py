"""/metrics after the engine dies: in-flight requests count as failed, gauges drop to 0."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from paged.scheduler import SamplingParams
from paged.server.async_llm import AsyncLLM
from paged.server.engine.errors import EngineDeadError
from paged.server.metrics import PrometheusStatLogger

MODEL = "tiny"


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample by its vLLM name without the prefix (paged:, or vllm: where exported)."""
    want = {"model_name": MODEL, **labels}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name.split(":", 1)[-1] == name and sample.labels == want:
                return float(sample.value)
    raise AssertionError(f"no sample {name} {want}")


async def test_engine_death_counts_in_flight_requests_as_errors(
    tokenizer: Any, fake_engine: Any
) -> None:
    stats = PrometheusStatLogger(MODEL)
    llm = AsyncLLM(fake_engine, tokenizer, max_model_len=128, stat_loggers=[stats])
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    gens = [llm.generate("hello world", params, f"r{i}") for i in range(2)]
    gens.append(llm.generate("hello world", SamplingParams(max_tokens=100, n=2), "fan"))
    for gen in gens:
        await anext(gen)  # every request is running
    reg = stats.registry
    assert _value(reg, "num_requests_running") == 4  # two plus the n=2 pair
    assert _value(reg, "kv_cache_usage_perc") > 0
    fake_engine.kill()
    for gen in gens:
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
    await asyncio.sleep(0)
    assert _value(reg, "request_success_total", finished_reason="error") == 4
    assert _value(reg, "request_success_total", finished_reason="abort") == 0
    assert _value(reg, "num_requests_running") == 0
    assert _value(reg, "num_requests_waiting") == 0
    assert _value(reg, "kv_cache_usage_perc") == 0
    assert _value(reg, "e2e_request_latency_seconds_count") == 4
    llm.shutdown()
