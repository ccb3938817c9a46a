"""AsyncMPClient: the background reader task, utilities and engine death."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from typing import Any

import pytest

from paged.server.engine.client import AsyncMPClient
from paged.server.engine.errors import EngineDeadError
from paged.server.engine.launch import EngineProcess
from paged.server.engine.messages import EngineCoreInfo

pytestmark = pytest.mark.timeout(180)


async def test_requests_and_utilities(fake_core_cls: Any, request_factory: Any) -> None:
    client = AsyncMPClient(fake_core_cls)
    try:
        await client.add_request_async(request_factory("a", [7], max_tokens=4))
        await client.add_request_async(request_factory("b", [3], max_tokens=1))
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        finished: set[str] = set()
        while finished != {"a", "b"}:
            batch = await asyncio.wait_for(client.get_output_async(), 20)
            for out in batch.outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    finished.add(out.request_id)
        assert tokens == {"a": [7, 8, 9, 10], "b": [3]}
        # Concurrent utility calls are matched to their own results.
        info, healthy, unfinished = await asyncio.gather(
            client.call_utility_async("get_info"),
            client.call_utility_async("is_healthy"),
            client.call_utility_async("get_num_unfinished_requests"),
        )
        assert info == client.info and isinstance(info, EngineCoreInfo)
        assert healthy is True and unfinished == 0
        await client.check_health_async()
        assert client.dead_error is None
    finally:
        client.shutdown()
    assert isinstance(client._engine, EngineProcess)
    assert client._engine.process.exitcode == 0
    with pytest.raises(EngineDeadError):
        await client.get_output_async()


async def test_abort_async(fake_core_cls: Any, request_factory: Any) -> None:
    client = AsyncMPClient(functools.partial(fake_core_cls, step_sleep_s=0.01))
    try:
        await client.add_request_async(request_factory("x", [1], max_tokens=100_000))
        await asyncio.wait_for(client.get_output_async(), 20)
        await client.abort_requests_async(["x"])
        deadline = time.monotonic() + 20
        while await client.call_utility_async("get_num_unfinished_requests"):
            assert time.monotonic() < deadline
    finally:
        client.shutdown()


async def test_killed_engine_fails_every_waiter_promptly(
    fake_core_cls: Any, request_factory: Any
) -> None:
    client = AsyncMPClient(functools.partial(fake_core_cls, step_sleep_s=0.05))
    try:
        await client.add_request_async(request_factory("x", [1], max_tokens=100_000))
        await asyncio.wait_for(client.get_output_async(), 20)
        # Drain what is queued so the next get has to wait for the engine.
        waiters = [asyncio.ensure_future(client.get_output_async()) for _ in range(3)]
        await asyncio.sleep(0.1)
        pid = client.engine_pid
        assert pid is not None
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while True:
            try:
                await asyncio.wait_for(client.get_output_async(), 10)
            except EngineDeadError as exc:
                assert "died unexpectedly" in str(exc)
                break
        assert time.monotonic() - killed_at < 5
        for waiter in waiters:
            try:
                await asyncio.wait_for(waiter, 5)
            except EngineDeadError:
                continue
        assert isinstance(client.dead_error, EngineDeadError)
        with pytest.raises(EngineDeadError):
            await client.add_request_async(request_factory("late", [1]))
        with pytest.raises(EngineDeadError):
            await client.call_utility_async("is_healthy")
    finally:
        client.shutdown()


async def test_utility_pending_when_engine_dies(fake_core_cls: Any) -> None:
    client = AsyncMPClient(functools.partial(fake_core_cls, step_sleep_s=5.0))
    try:
        await client.call_utility_async("is_healthy")  # start the reader
        pid = client.engine_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the call below cannot be answered
        call = asyncio.ensure_future(client.call_utility_async("get_stats"))
        await asyncio.sleep(0.2)
        assert not call.done()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(call, 5)
    finally:
        client.shutdown()


def test_constructed_outside_a_loop_and_used_in_one(
    fake_core_cls: Any, request_factory: Any
) -> None:
    client = AsyncMPClient(fake_core_cls)

    async def run() -> list[int]:
        await client.add_request_async(request_factory("a", [2], max_tokens=2))
        tokens: list[int] = []
        while len(tokens) < 2:
            tokens += (
                (await asyncio.wait_for(client.get_output_async(), 20)).outputs[0].new_token_ids
            )
        return tokens

    try:
        assert asyncio.run(run()) == [2, 3]
    finally:
        client.shutdown()
