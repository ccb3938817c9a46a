"""SyncMPClient against a scripted engine core in a real spawned process."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from paged.scheduler.boundary import EngineCoreOutputs, EngineCoreRequest, FinishReason
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.client import SyncMPClient
from paged.server.engine.errors import EngineDeadError, EngineStartupError
from paged.server.engine.messages import EngineCoreStats

pytestmark = pytest.mark.timeout(180)


def collect(client: SyncMPClient, request_ids: set[str]) -> dict[str, list[int]]:
    """Gather tokens until every id in `request_ids` finished."""
    tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
    pending = set(request_ids)
    while pending:
        batch = client.get_output(timeout=20)
        for out in batch.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                pending.discard(out.request_id)
    return tokens


def test_requests_utilities_and_clean_shutdown(fake_core_cls: Any, request_factory: Any) -> None:
    client = SyncMPClient(fake_core_cls)
    try:
        assert client.info.num_gpu_blocks == 7 and client.info.block_size == 16
        client.add_request(request_factory("a", [10], max_tokens=3))
        client.add_request(request_factory("b", [50, 60], max_tokens=2))
        assert collect(client, {"a", "b"}) == {"a": [10, 11, 12], "b": [60, 61]}
        stats = client.call_utility("get_stats")
        assert isinstance(stats, EngineCoreStats)
        assert stats.num_requests_added == 2
        assert client.call_utility("get_num_unfinished_requests") == 0
        assert client.call_utility("is_healthy") is True
        with pytest.raises(RuntimeError, match="cannot reset while requests run"):
            client.call_utility("reset_prefix_cache", "raise")
        with pytest.raises(ValueError, match="not an engine utility"):
            client.call_utility("__init__")
        with pytest.raises(RuntimeError, match="result of type object cannot be sent"):
            client.call_utility("get_info", "unencodable")
        assert client.call_utility("get_info") == client.info  # still serving
        pid = client._engine.process.pid
    finally:
        client.shutdown()
    assert client._engine.process.exitcode == 0  # left through SHUTDOWN, not a kill
    assert pid is not None
    with pytest.raises(EngineDeadError, match="shut down"):
        client.add_request(request_factory("c", [1]))
    with pytest.raises(EngineDeadError):
        client.get_output(timeout=1)
    client.shutdown()  # idempotent


def test_multimodal_tensors_cross_the_process_intact(fake_core_cls: Any) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB, sent as its own frame
    feature = MultiModalFeatureSpec(
        "image",
        "h0",
        PlaceholderRange(offset=0, length=2),
        {"pixels": TensorData("uint8", [len(big)], big)},
    )
    request = EngineCoreRequest(
        "mm", [1, 2], SamplingParams(max_tokens=1), None, 0.0, mm_features=[feature]
    )
    client = SyncMPClient(fake_core_cls)
    try:
        client.add_request(request)
        assert collect(client, {"mm"}) == {"mm": [zlib.crc32(big)]}
    finally:
        client.shutdown()


def test_invalid_request_finishes_with_error_output(
    fake_core_cls: Any, request_factory: Any
) -> None:
    client = SyncMPClient(fake_core_cls)
    try:
        client.add_request(request_factory("bad", []))
        batch = client.get_output(timeout=20)
        (out,) = batch.outputs
        assert out.request_id == "bad"
        assert out.finish_reason is FinishReason.ERROR
        assert out.finish_detail == "prompt_token_ids must not be empty"
        # The engine keeps serving.
        client.add_request(request_factory("ok", [5], max_tokens=1))
        assert collect(client, {"ok"}) == {"ok": [5]}
    finally:
        client.shutdown()


def test_abort_stops_a_running_request(fake_core_cls: Any, request_factory: Any) -> None:
    client = SyncMPClient(functools.partial(fake_core_cls, step_sleep_s=0.01))
    try:
        client.add_request(request_factory("long", [1], max_tokens=100_000))
        first = client.get_output(timeout=20)
        assert first.outputs[0].request_id == "long"
        client.abort_requests(["long"])
        client.abort_requests([])  # nothing to send
        deadline = time.monotonic() + 20
        while client.call_utility("get_num_unfinished_requests") != 0:
            assert time.monotonic() < deadline
        assert client.call_utility("get_stats").num_requests_aborted == 1
    finally:
        client.shutdown()


def test_startup_error_is_one_clear_exception(fake_core_cls: Any) -> None:
    start = time.monotonic()
    with pytest.raises(EngineStartupError) as info:
        SyncMPClient(functools.partial(fake_core_cls, fail_on_init=True))
    assert "FileNotFoundError: model path '/no/such/model' does not exist" in str(info.value)
    assert info.value.engine_traceback is not None
    assert "conftest.py" in info.value.engine_traceback  # where it broke
    assert time.monotonic() - start < 30


def test_startup_timeout_stops_the_process(fake_core_cls: Any) -> None:
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match=r"not ready within 1\.0 s"):
        SyncMPClient(functools.partial(fake_core_cls, init_sleep_s=120), startup_timeout_s=1.0)
    assert time.monotonic() - start < 60  # not the 120 s the core would take
    with pytest.raises(ValueError, match="startup_timeout_s"):
        SyncMPClient(fake_core_cls, startup_timeout_s=0)


def test_process_exit_before_handshake_is_reported(exit_factory: Any) -> None:
    with pytest.raises(EngineStartupError, match="exited with code 3 before it was ready"):
        SyncMPClient(exit_factory)


def test_crash_inside_a_step_reaches_the_waiter(fake_core_cls: Any, request_factory: Any) -> None:
    client = SyncMPClient(functools.partial(fake_core_cls, crash_after_steps=1))
    try:
        client.add_request(request_factory("a", [1], max_tokens=10))
        got: list[EngineCoreOutputs] = [client.get_output(timeout=20)]
        with pytest.raises(EngineDeadError, match="simulated failure inside a step"):
            got.append(client.get_output(timeout=20))
        assert len(got) == 1
        with pytest.raises(EngineDeadError):
            client.call_utility("is_healthy")
    finally:
        client.shutdown()


def test_unencodable_output_kills_the_engine_loudly(
    fake_core_cls: Any, request_factory: Any
) -> None:
    client = SyncMPClient(functools.partial(fake_core_cls, unencodable_output=True))
    try:
        client.add_request(request_factory("a", [1], max_tokens=3))
        with pytest.raises(EngineDeadError, match="cannot encode its output"):
            client.get_output(timeout=30)
        # The client's monitor thread reaps the process too; a join racing it
        # can return before the exit code is recorded, so wait for the code.
        deadline = time.monotonic() + 30
        while client._engine.process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client._engine.process.exitcode == 1
    finally:
        client.shutdown()


def test_killed_engine_wakes_blocked_waiters(fake_core_cls: Any, request_factory: Any) -> None:
    client = SyncMPClient(fake_core_cls)
    errors: list[BaseException] = []

    def wait_for_output() -> None:
        try:
            client.get_output()  # no timeout: only the death notice can end this
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait_for_output)
    waiter.start()
    try:
        pid = client._engine.process.pid
        assert pid is not None
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        waiter.join(timeout=10)
        assert not waiter.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError)
        assert "died unexpectedly" in str(errors[0])
        assert client.dead_error is errors[0]
        with pytest.raises(EngineDeadError):
            client.add_request(request_factory("late", [1]))
    finally:
        client.shutdown()


_FRONTEND = """
import sys, time
from packages.server.tests.conftest import FakeCore
from paged.server.engine.client import SyncMPClient
client = SyncMPClient(FakeCore)
print(client._engine.process.pid, flush=True)
time.sleep(600)
"""


def test_engine_exits_when_its_frontend_is_killed() -> None:
    # Run from the repository root, so that the engine process can import the
    # conftest module its factory lives in (as under pytest).
    root = Path(__file__).resolve().parents[3]
    with subprocess.Popen(
        [sys.executable, "-c", _FRONTEND], cwd=root, stdout=subprocess.PIPE, text=True
    ) as frontend:
        try:
            assert frontend.stdout is not None
            engine_pid = int(frontend.stdout.readline())
            assert pid_alive(engine_pid)
            frontend.kill()
            frontend.wait(timeout=10)
            deadline = time.monotonic() + 30
            while pid_alive(engine_pid):
                assert time.monotonic() < deadline, "engine outlived its frontend"
                time.sleep(0.1)
        finally:
            frontend.kill()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
