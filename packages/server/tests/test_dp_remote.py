"""Multi-node DP on loopback: a frontend with a local engine plus a headless node.

The headless node is its own OS process (`run_headless`, what
`paged serve --headless` runs), whose engine connects over TCP to the
sockets the frontend's rendezvous assigned it. FakeCore engines: no model.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import signal
import socket
import sys
import time
from multiprocessing.process import BaseProcess
from typing import Any

import pytest

from paged.scheduler.boundary import FinishReason
from paged.server.engine.client import AsyncMPClient
from paged.server.engine.dp_client import DPLBAsyncClient
from paged.server.engine.dp_launch import DPRankFactory
from paged.server.engine.dp_remote import DPRendezvous, run_headless
from paged.server.engine.errors import EngineStartupError
from paged.server.engine.messages import EngineCoreStats

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _headless_entry(factories: list[DPRankFactory], port: int) -> None:
    """What `paged serve --headless` does after building its factories."""
    sys.exit(run_headless(factories, "127.0.0.1", port, register_timeout_s=60.0))


def _start_headless(fake_core_cls: Any, port: int, rank: int = 1) -> BaseProcess:
    factory = DPRankFactory(functools.partial(fake_core_cls, step_sleep_s=0.01), rank)
    process = multiprocessing.get_context("spawn").Process(
        target=_headless_entry, args=([factory], port), name="headless-node"
    )
    process.start()
    return process


def _frontend(fake_core_cls: Any, port: int) -> DPLBAsyncClient:
    rendezvous = DPRendezvous("127.0.0.1", port)
    try:
        local = AsyncMPClient(functools.partial(fake_core_cls, step_sleep_s=0.01))
        (remote,) = rendezvous.accept([1], timeout_s=60)
    except BaseException:
        rendezvous.close()
        raise
    return DPLBAsyncClient([local, AsyncMPClient.attach(remote)], closers=[rendezvous.close])


async def _run_to_end(client: DPLBAsyncClient, ids: set[str]) -> dict[str, Any]:
    done: dict[str, Any] = {}
    deadline = time.monotonic() + 30
    while ids - done.keys():
        batch = await asyncio.wait_for(client.get_output_async(), deadline - time.monotonic())
        for out in batch.outputs:
            if out.finish_reason is not None and out.request_id in ids:
                done[out.request_id] = (out.finish_reason, out.finish_detail, batch.engine_index)
    return done


@pytest.mark.parametrize("kill", ["engine", "node"])
async def test_headless_rank_serves_and_its_death_is_seen(
    fake_core_cls: Any, request_factory: Any, kill: str
) -> None:
    port = _free_port()
    node = _start_headless(fake_core_cls, port)
    client = _frontend(fake_core_cls, port)
    try:
        assert client.engines[1].engine_pid != os.getpid()
        for i in range(8):
            await client.add_request_async(request_factory(f"q{i}", [i], max_tokens=2))
        done = await _run_to_end(client, {f"q{i}" for i in range(8)})
        assert all(reason is FinishReason.LENGTH for reason, _, _ in done.values())
        remote_stats = await client.call_utility_on(1, "get_stats")
        assert isinstance(remote_stats, EngineCoreStats)
        assert remote_stats.num_requests_added == 4  # counted by the remote engine itself
        # Kill the remote engine mid-request: its requests fail, the local one serves.
        for i in range(4):
            await client.add_request_async(request_factory(f"x{i}", [1], max_tokens=100_000))
        await client.get_output_async()
        victims = {f"x{i}" for i in range(4) if client.engine_of(f"x{i}") == 1}
        killed_at = time.monotonic()
        if kill == "engine":
            os.kill(client.engines[1].engine_pid, signal.SIGKILL)
        else:  # the node's supervisor: its engine follows it (parent death), then TCP drops
            assert node.pid is not None
            os.kill(node.pid, signal.SIGKILL)
        failed = await _run_to_end(client, victims)
        assert time.monotonic() - killed_at < 10
        for reason, detail, engine in failed.values():
            assert reason is FinishReason.ERROR and engine == 1
            assert "data-parallel engine 1" in detail and "disconnected" in detail
        await client.add_request_async(request_factory("after", [3], max_tokens=1))
        assert client.engine_of("after") == 0
        node.join(timeout=20)
        # Its engine died: the node says so and exits 1 (or was killed itself).
        assert node.exitcode == (1 if kill == "engine" else -signal.SIGKILL)
    finally:
        client.shutdown()
        if node.is_alive():
            node.kill()


async def test_frontend_shutdown_stops_the_headless_node(fake_core_cls: Any) -> None:
    port = _free_port()
    node = _start_headless(fake_core_cls, port)
    client = _frontend(fake_core_cls, port)
    client.shutdown()  # sends SHUTDOWN to the remote engine
    node.join(timeout=20)
    assert node.exitcode == 0


async def test_frontend_vanishing_stops_the_headless_node(fake_core_cls: Any) -> None:
    port = _free_port()
    node = _start_headless(fake_core_cls, port)
    rendezvous = DPRendezvous("127.0.0.1", port)
    try:
        rendezvous.accept([1], timeout_s=60)
    finally:
        rendezvous.close()  # connections drop without any SHUTDOWN, as if it crashed
    node.join(timeout=30)
    assert node.exitcode == 0 and not node.is_alive()


def test_unexpected_rank_is_refused(fake_core_cls: Any) -> None:
    port = _free_port()
    node = _start_headless(fake_core_cls, port, rank=3)
    rendezvous = DPRendezvous("127.0.0.1", port)
    try:
        with pytest.raises(EngineStartupError, match=r"ranks \[1\] did not register"):
            rendezvous.accept([1], timeout_s=3)
        node.join(timeout=20)
        assert node.exitcode == 1  # told why, and gave up
    finally:
        rendezvous.close()
        if node.is_alive():
            node.kill()


def test_busy_port_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match="data_parallel_rpc_port"):
            DPRendezvous("127.0.0.1", port)
