"""End to end: the engine process dies under a live server; nothing hangs.

In-flight streams end with an error event and `data: [DONE]`, /health turns
503, later requests get a 500 in OpenAI's error schema, and the API process
itself stays up to say so.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.conftest import LiveServer

pytestmark = pytest.mark.slow


def test_engine_death_fails_requests_and_health(launch_server: Callable[..., LiveServer]) -> None:
    server = launch_server("--max-model-len", "256", "--kv-cache-memory", "64MiB")
    (engine_pid,) = server.engine_pids()
    body = {"prompt": "Write a long story.", "max_tokens": 200, "stream": True}
    with (
        httpx.Client(timeout=120) as h,
        h.stream("POST", f"{server.base_url}/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break  # generation is under way
        os.kill(engine_pid, signal.SIGKILL)
        rest = [line for line in lines if line]  # must end on its own
    assert rest[-1] == "data: [DONE]"
    errors = [json.loads(x[6:]) for x in rest[:-1] if '"error"' in x]
    assert errors and errors[-1]["error"]["type"] == "server_error"
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.base_url}/health").status_code != 503:
        assert time.monotonic() < deadline, "/health never reported the dead engine"
        time.sleep(0.5)
    resp2 = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert resp2.status_code == 500
    assert resp2.json()["error"]["type"] == "server_error"
    assert server.process.poll() is None  # the API server is still there to answer
