"""Data parallelism on the default model: DP=2 (two local engine processes) equals DP=1.

The default model (SmolLM2-135M-Instruct GGUF) at its default dtype, i.e. the
quantized path users run, behind `AsyncLLM` with the engine client `paged
serve -dp N` builds (`open_async_llm`): DP=1 is one engine process, DP=2 two
local ones (`tests/test_e2e_data_parallel.py` covers a headless remote rank on
a tiny random model through the CLI).

Why token equality holds on the quantized path here: its int4 kernel is one
GEMV per row, so a request's logits do not depend on what else is in the
batch, but at `LARGE_BATCH_ROWS` (64) rows per step the layers switch to a
bf16 GEMM copy, whose rounding differs. DP=1 (all prompts in one engine)
and DP=2 (half each, arriving at different times) batch differently, so the
prompts are kept under 64 tokens in all (the test checks it): every step of
both runs then stays on the int4 kernel. Prompts past that would need
`--dtype float32` for a token-for-token comparison.

Then, on the same DP=2 engines: each engine served its share (its own
`get_stats` counters and `engine="<i>"` metrics agree); an abort reaches the
engine that holds the request, and only that one, and is counted under its
label; a killed local engine fails its in-flight request within seconds with
a clear error while the other engine finishes its own and serves new ones,
and `health_error` (what /health answers 503 with) names the dead engine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from paged.runner.layers.quantized_linear import LARGE_BATCH_ROWS
from paged.scheduler import SamplingParams
from paged.server.async_llm import AsyncLLM
from paged.server.data_parallel import DataParallelOptions, open_async_llm
from paged.server.engine.dp_client import DPLBAsyncClient
from paged.server.engine.messages import EngineCoreStats
from paged.server.engine_args import EngineArgs
from paged.server.metrics import PrometheusStatLogger
from paged.server.metrics_names import VLLM_NAMING
from paged.server.outputs import RequestOutput

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL_NAME = "default"
MAX_TOKENS = 16
LONG_TOKENS = 160  # long enough to be in flight across the abort and the kill
PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "How do vaccines work?",
    "Give me a recipe for pancakes.",
    "Tell me a story about a robot.",
    "Describe a sunrise.",
]
ARGS = EngineArgs(model=None, device="cpu", max_model_len=512, kv_cache_memory_bytes=64 << 20)


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _final(llm: AsyncLLM, prompt: str, rid: str, max_tokens: int = MAX_TOKENS) -> Any:
    final: RequestOutput | None = None
    async for out in llm.generate(prompt, _greedy(max_tokens), rid):
        final = out
    assert final is not None
    return final


async def _all(llm: AsyncLLM, tag: str) -> list[Any]:
    return list(await asyncio.gather(*(_final(llm, p, f"{tag}{i}") for i, p in enumerate(PROMPTS))))


async def _stats(client: DPLBAsyncClient, index: int) -> EngineCoreStats:
    stats = await client.call_utility_on(index, "get_stats")
    assert isinstance(stats, EngineCoreStats)
    return stats


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    want = {"model_name": MODEL_NAME, **labels}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == f"vllm:{name}" and sample.labels == want:
                return float(sample.value)
    raise AssertionError(f"no sample vllm:{name} {want}")


@pytest.fixture(scope="module")
def dp1_outputs() -> list[Any]:
    async def run() -> list[Any]:
        llm = open_async_llm(ARGS, DataParallelOptions(size=1))
        try:
            return await _all(llm, "one")
        finally:
            llm.shutdown()

    return asyncio.run(run())


def test_dp2_equals_dp1_then_aborts_metrics_and_a_killed_local_engine(
    dp1_outputs: list[Any],
) -> None:
    want = [list(o.outputs[0].token_ids) for o in dp1_outputs]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in dp1_outputs)
    assert LARGE_BATCH_ROWS is not None and prompt_tokens < LARGE_BATCH_ROWS, prompt_tokens
    assert all(len(t) == MAX_TOKENS for t in want)
    asyncio.run(_dp2_checks(want))


async def _dp2_checks(want: list[list[int]]) -> None:
    metrics = PrometheusStatLogger(MODEL_NAME, naming=VLLM_NAMING, num_engines=2)
    llm = open_async_llm(ARGS, DataParallelOptions(size=2), stat_loggers=[metrics])
    client = llm.engine_client
    assert isinstance(client, DPLBAsyncClient) and client.num_engines == 2
    reg = metrics.registry
    try:
        pids = [engine.engine_pid for engine in client.engines]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        got = [list(o.outputs[0].token_ids) for o in await _all(llm, "two")]
        assert got == want  # token for token

        # Both engines served; their own counters and their metric labels agree.
        added = [(await _stats(client, i)).num_requests_added for i in (0, 1)]
        assert sum(added) == len(PROMPTS) and min(added) > 0, added
        for i in (0, 1):
            engine = str(i)
            assert _value(reg, "generation_tokens_total", engine=engine) == MAX_TOKENS * added[i]
            assert (
                _value(reg, "request_success_total", engine=engine, finished_reason="length")
                == added[i]
            )
            assert _value(reg, "num_requests_running", engine=engine) == 0

        # Two long requests, one per engine (the idle engines take turns).
        long = {
            f"long{i}": llm.generate(PROMPTS[i], _greedy(LONG_TOKENS), f"long{i}") for i in (0, 1)
        }
        for gen in long.values():
            await anext(gen)
        # The engines' ids are the callers' plus a random suffix (vLLM 0.33).
        states = llm.output_processor.request_states.values()
        holder = {client.engine_of(s.request_id): s.external_id for s in states}
        assert set(holder) == {0, 1}, holder
        await llm.abort(holder[1])  # only engine 1 may see an abort
        deadline = time.monotonic() + 20
        while (await _stats(client, 1)).num_requests_aborted != 1:
            assert time.monotonic() < deadline, "engine 1 never saw the abort"
            await asyncio.sleep(0.05)
        assert (await _stats(client, 0)).num_requests_aborted == 0
        assert _value(reg, "request_success_total", engine="1", finished_reason="abort") == 1
        assert _value(reg, "request_success_total", engine="0", finished_reason="abort") == 0
        assert await client.call_utility_async("get_num_unfinished_requests") == 1

        # A third long request goes to engine 1 (engine 0 still runs its own); kill engine 1.
        victim = llm.generate(PROMPTS[2], _greedy(LONG_TOKENS), "victim")
        await anext(victim)
        (victim_id,) = (
            s.request_id for s in llm.output_processor.request_states.values()
            if s.external_id == "victim"
        )  # fmt: skip
        assert client.engine_of(victim_id) == 1
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        victim_outs = [out async for out in victim]
        assert time.monotonic() - killed_at < 10
        failed = victim_outs[-1]
        assert failed.finished and failed.outputs[0].finish_reason == "error"
        assert "data-parallel engine 1 died" in (failed.finish_detail or ""), failed
        assert llm.dead_error is None  # the survivor serves on ...
        health = llm.health_error
        assert health is not None and "engine 1 is dead" in str(health)  # ... /health is 503
        assert "1 of 2 engines still serve" in str(health)
        # Engine 0's request runs to its end; a new request goes to engine 0 and
        # still gets DP=1's tokens.
        rest = [out async for out in long[holder[0]]]
        assert rest[-1].outputs[0].finish_reason == "length"
        assert len(rest[-1].outputs[0].token_ids) == LONG_TOKENS
        again = await _final(llm, PROMPTS[3], "after")
        assert list(again.outputs[0].token_ids) == want[3]
        assert _value(reg, "request_success_total", engine="1", finished_reason="error") == 1
        assert _value(reg, "num_requests_running", engine="1") == 0
    finally:
        llm.shutdown()
