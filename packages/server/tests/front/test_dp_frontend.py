"""AsyncLLM over DPLBAsyncClient with in-process fake engines (no processes).

The frontend's side of data parallelism: outputs equal one engine's, each
engine's own counters and `engine="<i>"` metrics, a dead engine's requests
finishing with an error while the other serves, /health's `health_error`.
"""

from __future__ import annotations

import argparse
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from paged.scheduler import SamplingParams
from paged.server.async_llm import AsyncLLM
from paged.server.cli import build_parser
from paged.server.data_parallel import DataParallelOptions, data_parallel_options_from
from paged.server.engine.dp_client import DPLBAsyncClient
from paged.server.metrics import PrometheusStatLogger
from paged.server.metrics_names import VLLM_NAMING

MODEL = "tiny"


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    want = {"model_name": MODEL, **labels}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name.split(":", 1)[-1] == name and sample.labels == want:
                return float(sample.value)
    raise AssertionError(f"no sample {name} {want}")


async def _final(llm: AsyncLLM, prompt: str, rid: str, max_tokens: int) -> Any:
    final = None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async for out in llm.generate(prompt, params, rid):
        final = out
    return final


async def test_dp_outputs_match_one_engine_and_metrics_are_per_engine(
    tokenizer: Any, engine_cls: Any
) -> None:
    single = AsyncLLM(engine_cls(), tokenizer, max_model_len=128)
    engines = [engine_cls(), engine_cls()]
    stats = PrometheusStatLogger(MODEL, num_engines=2)
    dp = AsyncLLM(
        DPLBAsyncClient(cast(Any, engines)), tokenizer, max_model_len=128, stat_loggers=[stats]
    )
    prompts = [f"hello world {i}" for i in range(8)]
    try:
        for i, p in enumerate(prompts):
            one = await _final(single, p, f"s{i}", 5)
            two = await _final(dp, p, f"d{i}", 5)
            assert two.outputs[0].token_ids == one.outputs[0].token_ids
            assert two.outputs[0].text == one.outputs[0].text
        assert [len(e.added) for e in engines] == [4, 4]  # each engine's own count
        reg = stats.registry
        for engine in ("0", "1"):
            assert _value(reg, "generation_tokens_total", engine=engine) == 4 * 5
            assert (
                _value(reg, "request_success_total", engine=engine, finished_reason="length") == 4
            )
    finally:
        single.shutdown()
        dp.shutdown()


async def test_dead_engine_fails_its_requests_the_other_serves(
    tokenizer: Any, engine_cls: Any
) -> None:
    engines = [engine_cls(step_delay=0.01), engine_cls(step_delay=0.01)]
    stats = PrometheusStatLogger(MODEL, naming=VLLM_NAMING, num_engines=2)
    llm = AsyncLLM(
        DPLBAsyncClient(cast(Any, engines)), tokenizer, max_model_len=128, stat_loggers=[stats]
    )
    try:
        gens = [llm.generate("hello", SamplingParams(max_tokens=100, ignore_eos=True), f"r{i}")
                for i in range(4)]  # fmt: skip
        for gen in gens:
            await anext(gen)
        assert llm.health_error is None
        engines[1].kill()
        finals = []
        for gen in gens:
            outs = [out async for out in gen]
            finals.append(outs[-1])
        failed = [f for f in finals if f.outputs[0].finish_reason == "error"]
        assert len(failed) == 2  # the two on engine 1
        assert all("data-parallel engine 1 died" in (f.finish_detail or "") for f in failed)
        assert llm.dead_error is None  # still accepting requests ...
        health = llm.health_error
        assert health is not None and "engine 1 is dead" in str(health)  # ... /health is 503
        ok = await _final(llm, "hello world", "after", 3)
        assert ok.outputs[0].finish_reason == "length"
        assert [len(e.added) for e in engines] == [3, 2]  # the new one went to engine 0
        reg = stats.registry
        assert _value(reg, "request_success_total", engine="1", finished_reason="error") == 2
        assert _value(reg, "num_requests_running", engine="1") == 0
        engines[0].kill()
        with pytest.raises(Exception, match="all 2 data-parallel engines are dead"):
            await _final(llm, "hello", "late", 3)
        assert llm.dead_error is not None
    finally:
        llm.shutdown()


async def test_aborts_reach_their_engine_and_count_under_it(
    tokenizer: Any, engine_cls: Any
) -> None:
    """A frontend abort (client disconnect, `AsyncLLM.abort`) goes to the engine that
    holds the request and is counted under that engine's label, n > 1 children too."""
    engines = [engine_cls(step_delay=0.01), engine_cls(step_delay=0.01)]
    stats = PrometheusStatLogger(MODEL, naming=VLLM_NAMING, num_engines=2)
    client = DPLBAsyncClient(cast(Any, engines))
    llm = AsyncLLM(client, tokenizer, max_model_len=128, stat_loggers=[stats])
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    try:
        gens = [llm.generate("hello", long, f"r{i}") for i in range(2)]
        for gen in gens:
            await anext(gen)
        # The engines' ids: the callers' plus a random suffix (vLLM 0.33).
        r0, r1 = engines[0].added[0].request_id, engines[1].added[0].request_id
        assert r0.startswith("r0-") and r1.startswith("r1-")  # each to the lighter one
        assert [client.engine_of(r0), client.engine_of(r1)] == [0, 1]
        await llm.abort("r1")
        assert engines[1].aborted == [r1] and engines[0].aborted == []
        await gens[0].aclose()  # a client disconnect
        assert engines[0].aborted == [r0] and engines[1].aborted == [r1]
        reg = stats.registry
        assert _value(reg, "request_success_total", engine="0", finished_reason="abort") == 1
        assert _value(reg, "request_success_total", engine="1", finished_reason="abort") == 1
        # n=2: the children are balanced one by one, so one lands on each engine;
        # aborting the parent sends each engine its own child and counts it there.
        pair = llm.generate("hello", SamplingParams(n=2, max_tokens=100, ignore_eos=True), "p")
        await anext(pair)
        children = [[r.request_id for r in e.added[1:]] for e in engines]
        assert [len(c) for c in children] == [1, 1], children
        await llm.abort("p")
        assert engines[0].aborted[1:] == children[0] and engines[1].aborted[1:] == children[1]
        assert _value(reg, "request_success_total", engine="0", finished_reason="abort") == 2
        assert _value(reg, "request_success_total", engine="1", finished_reason="abort") == 2
    finally:
        llm.shutdown()


def test_record_engine_checks_the_index() -> None:
    stats = PrometheusStatLogger(MODEL, num_engines=2)
    with pytest.raises(ValueError, match="engine_index"):
        stats.record_engine(2, None, None)
    with pytest.raises(ValueError, match="num_engines"):
        PrometheusStatLogger(MODEL, num_engines=0)


def _ns(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_dp_flags_parse_as_vllms() -> None:
    opts = data_parallel_options_from(
        _ns("-dp", "4", "-dpl", "2", "-dpa", "10.0.0.1", "-dpp", "13345")
    )
    assert opts == DataParallelOptions(size=4, size_local=2, address="10.0.0.1", rpc_port=13345)
    assert opts.num_local == 2 and opts.remote_ranks == [2, 3]
    headless = data_parallel_options_from(
        _ns("--headless", "--data-parallel-size", "4", "--data-parallel-size-local", "2",
            "--data-parallel-start-rank", "2")
    )  # fmt: skip
    assert headless.headless and headless.num_local == 2 and headless.remote_ranks == []
    assert data_parallel_options_from(_ns()) == DataParallelOptions()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 0}, "data_parallel_size"),
        ({"size": 2, "start_rank": 2, "headless": True}, "data_parallel_start_rank"),
        ({"size": 2, "start_rank": 1}, "only a --headless node"),
        ({"size": 2, "size_local": 3}, "data_parallel_size_local"),
        ({"size": 2, "start_rank": 1, "size_local": 0, "headless": True}, "must run >= 1"),
        ({"size": 2, "rpc_port": 0}, "data_parallel_rpc_port"),
    ],
)
def test_bad_dp_options_name_the_flag(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataParallelOptions(**kwargs)
