"""DPLBAsyncClient over real engine processes (FakeCore): balance, aborts, death.

Per-engine counts come from each engine's own `get_stats` utility (what the
engine process saw), not from the client's routing table.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from typing import Any

import pytest

from paged.scheduler.boundary import EngineCoreOutputs, FinishReason
from paged.server.engine.client import AsyncMPClient
from paged.server.engine.dp_client import DPLBAsyncClient
from paged.server.engine.errors import EngineDeadError
from paged.server.engine.messages import EngineCoreStats

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _dp(fake_core_cls: Any, n: int = 2, step_sleep_s: float = 0.01) -> DPLBAsyncClient:
    factory = functools.partial(fake_core_cls, step_sleep_s=step_sleep_s)
    return DPLBAsyncClient([AsyncMPClient(factory) for _ in range(n)])


async def _stats(client: DPLBAsyncClient, index: int) -> EngineCoreStats:
    stats = await client.call_utility_on(index, "get_stats")
    assert isinstance(stats, EngineCoreStats)
    return stats


async def _drain(
    client: DPLBAsyncClient, ids: set[str], timeout_s: float = 60
) -> dict[str, tuple[list[int], FinishReason, int, str | None]]:
    """Collect outputs until every id finished: tokens, reason, engine, detail."""
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    done: dict[str, tuple[list[int], FinishReason, int, str | None]] = {}
    deadline = time.monotonic() + timeout_s
    while ids - done.keys():
        batch: EngineCoreOutputs = await asyncio.wait_for(
            client.get_output_async(), deadline - time.monotonic()
        )
        for out in batch.outputs:
            if out.request_id not in got:
                continue
            got[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                done[out.request_id] = (
                    got[out.request_id],
                    out.finish_reason,
                    batch.engine_index,
                    out.finish_detail,
                )
    return done


async def test_64_requests_split_evenly_by_engine_counters(
    fake_core_cls: Any, request_factory: Any
) -> None:
    client = _dp(fake_core_cls)
    try:
        ids = {f"r{i}" for i in range(64)}
        for i in range(64):
            await client.add_request_async(request_factory(f"r{i}", [i + 1], max_tokens=3))
        done = await _drain(client, ids)
        # Every request ran to completion on the engine the client says it was sent to.
        assert all(reason is FinishReason.LENGTH for _, reason, _, _ in done.values())
        assert {rid: toks for rid, (toks, *_) in done.items()} == {
            f"r{i}": [i + 1, i + 2, i + 3] for i in range(64)
        }
        added = [(await _stats(client, i)).num_requests_added for i in range(2)]
        assert sum(added) == 64
        assert min(added) >= 0.4 * 64 and max(added) <= 0.6 * 64, added
        seen = [sum(1 for *_, eng, _ in done.values() if eng == i) for i in range(2)]
        assert seen == added  # batches are stamped with the engine that produced them
        # Utilities over every engine, combined.
        assert await client.call_utility_async("reset_prefix_cache") is True
        assert await client.call_utility_async("get_num_unfinished_requests") == 0
        await client.check_health_async()
        with pytest.raises(ValueError, match="engine_index"):
            await client.call_utility_on(2, "get_stats")
    finally:
        client.shutdown()


async def test_aborts_reach_the_holder_and_free_it_for_new_requests(
    fake_core_cls: Any, request_factory: Any
) -> None:
    client = _dp(fake_core_cls, step_sleep_s=0.02)
    try:
        # Four long requests land two per engine (round robin over equal loads).
        for i in range(4):
            await client.add_request_async(request_factory(f"long{i}", [1], max_tokens=100_000))
        await asyncio.sleep(0.5)  # both engines have reported their running counts
        ids = [f"long{i}" for i in range(4)]
        owned = [[rid for rid in ids if client.engine_of(rid) == e] for e in (0, 1)]
        assert [len(o) for o in owned] == [2, 2]
        # Engine 0's two are aborted (plus an unknown id): only engine 0 sees aborts.
        await client.abort_requests_async([*owned[0], "unknown-id"])
        assert client.engine_of(owned[0][0]) is None
        deadline = time.monotonic() + 20
        while (await _stats(client, 0)).num_requests_aborted != 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert (await _stats(client, 1)).num_requests_aborted == 0
        assert await client.call_utility_async("get_num_unfinished_requests") == 2
        # Engine 0's last report still counts two running; the frontend knows they are
        # gone (an idle engine reports no more), so it is the lighter one for new work.
        assert client.balancer.loads[0].score == 0
        assert client.balancer.loads[1].score == 2
        await client.add_request_async(request_factory("new0", [5], max_tokens=2))
        assert client.engine_of("new0") == 0
    finally:
        client.shutdown()


async def test_killed_engine_fails_its_requests_and_the_other_serves(
    fake_core_cls: Any, request_factory: Any
) -> None:
    client = _dp(fake_core_cls)
    try:
        for i in range(6):
            await client.add_request_async(request_factory(f"k{i}", [1], max_tokens=100_000))
        await client.get_output_async()
        victims = {f"k{i}" for i in range(6) if client.engine_of(f"k{i}") == 1}
        assert len(victims) == 3
        killed_at = time.monotonic()
        os.kill(client.engines[1].engine_pid, signal.SIGKILL)
        done = await _drain(client, victims, timeout_s=10)
        assert time.monotonic() - killed_at < 10
        for _tokens, reason, engine, detail in done.values():
            assert reason is FinishReason.ERROR and engine == 1
            assert detail is not None and "data-parallel engine 1 died" in detail
        assert client.dead_error is None  # the survivor serves on ...
        degraded = client.degraded_error
        assert degraded is not None and "engine 1 is dead" in str(degraded)  # ... /health 503
        for i in range(4):
            await client.add_request_async(request_factory(f"n{i}", [9], max_tokens=2))
            assert client.engine_of(f"n{i}") == 0  # only the live engine gets new work
        new = await _drain(client, {f"n{i}" for i in range(4)})
        assert all(toks == [9, 10] and eng == 0 for toks, _, eng, _ in new.values())
        os.kill(client.engines[0].engine_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="all 2 data-parallel engines are dead"):
            while True:
                await asyncio.wait_for(client.get_output_async(), 10)
        assert client.dead_error is not None
        with pytest.raises(EngineDeadError):
            await client.add_request_async(request_factory("late", [1]))
    finally:
        client.shutdown()


def test_needs_an_engine() -> None:
    with pytest.raises(ValueError, match="at least one"):
        DPLBAsyncClient([])
