"""The real EngineCore (scheduler, KV sizing) behind each client, with a fake executor."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from paged.scheduler.boundary import EngineCoreOutput, EngineCoreRequest, FinishReason
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.testing import next_token
from paged.server.engine.client import AsyncMPClient, InprocClient, SyncMPClient
from paged.server.engine.core import make_engine_core_factory

pytestmark = pytest.mark.timeout(300)


def req(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        eos_token_id=None,
        arrival_time=time.time(),
    )


def expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def record(got: dict[str, list[int]], done: set[str], outs: list[EngineCoreOutput]) -> None:
    for out in outs:
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            done.add(out.request_id)


def test_inproc_client(engine_config_factory: Any, fake_executor_cls: Any) -> None:
    client = InprocClient.from_factory(
        make_engine_core_factory(engine_config_factory(), fake_executor_cls)
    )
    client.add_request(req("a", [1, 2, 3], 4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        client.add_request(req("bad", [1000], 4))
    got: dict[str, list[int]] = {}
    done: set[str] = set()
    while client.has_work():
        record(got, done, client.get_output().outputs)
    assert got == {"a": expected([1, 2, 3], 4)} and done == {"a"}
    assert client.call_utility("get_num_unfinished_requests") == 0
    client.shutdown()


@pytest.mark.slow
def test_sync_mp_client_with_real_core(engine_config_factory: Any, fake_executor_cls: Any) -> None:
    factory = make_engine_core_factory(
        engine_config_factory(), fake_executor_cls, batch_queue_size=2
    )
    client = SyncMPClient(factory, startup_timeout_s=60)
    try:
        assert client.info.num_gpu_blocks == 64
        prompts = {"a": [1, 2, 3], "b": list(range(1, 41)), "bad": [500]}
        for rid, prompt in prompts.items():
            client.add_request(req(rid, prompt, 5))
        got: dict[str, list[int]] = {}
        done: set[str] = set()
        reasons: dict[str, FinishReason | None] = {}
        while done != set(prompts):
            batch = client.get_output(timeout=30)
            record(got, done, batch.outputs)
            reasons.update({o.request_id: o.finish_reason for o in batch.outputs if o.finished})
        assert got["a"] == expected([1, 2, 3], 5)
        assert got["b"] == expected(list(range(1, 41)), 5)
        assert got["bad"] == [] and reasons["bad"] is FinishReason.ERROR
        stats = client.call_utility("get_stats")
        assert stats.num_requests_added == 2 and stats.scheduler.kv_cache_usage == 0.0
    finally:
        client.shutdown()


@pytest.mark.slow
async def test_async_mp_client_with_real_core(
    engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    client = AsyncMPClient(make_engine_core_factory(engine_config_factory(), fake_executor_cls))
    try:
        for i in range(4):
            await client.add_request_async(req(f"r{i}", [i + 1, i + 2], 3))
        got: dict[str, list[int]] = {}
        done: set[str] = set()
        while len(done) < 4:
            record(got, done, (await asyncio.wait_for(client.get_output_async(), 30)).outputs)
        assert got == {f"r{i}": expected([i + 1, i + 2], 3) for i in range(4)}
        assert await client.call_utility_async("reset_prefix_cache") is True
    finally:
        client.shutdown()
