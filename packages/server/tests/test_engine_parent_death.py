"""The engine process exits soon after its frontend dies, busy or idle.

The frontend is a separate interpreter that starts an engine over `FakeCore`
and (for the busy cases) keeps it stepping through a request that would run
for hours; the test SIGKILLs the frontend (no cleanup runs there) and times
how long the orphaned engine lives on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

_FRONTEND = """
import functools, sys, time
from packages.server.tests.conftest import FakeCore, make_request
from paged.server.engine.client import SyncMPClient
step_s, busy = float(sys.argv[1]), sys.argv[2] == "busy"
client = SyncMPClient(functools.partial(FakeCore, step_sleep_s=step_s))
if busy:
    client.add_request(make_request("forever", [1], max_tokens=10**9))
    if step_s < 1:
        client.get_output(timeout=60)  # it is stepping
    else:
        time.sleep(0.5)  # inside its first, long step
print(client._engine.process.pid, flush=True)
time.sleep(600)
"""
# The watcher reacts at once; the process then stops its threads and exits.
EXIT_WITHIN_S = 2.0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("step_s", "state"),
    [(0.0, "idle"), (0.01, "busy"), (60.0, "busy")],
    ids=["idle", "busy", "inside-a-long-step"],
)
def test_engine_notices_its_frontend_died(step_s: float, state: str) -> None:
    # From the repository root, so the engine can import the conftest module
    # its factory lives in (as under pytest).
    root = Path(__file__).resolve().parents[3]
    with subprocess.Popen(
        [sys.executable, "-c", _FRONTEND, str(step_s), state],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    ) as frontend:
        engine_pid: int | None = None
        try:
            assert frontend.stdout is not None
            engine_pid = int(frontend.stdout.readline())
            assert pid_alive(engine_pid)
            frontend.send_signal(signal.SIGKILL)
            frontend.wait(timeout=10)
            killed = time.monotonic()
            while pid_alive(engine_pid) and time.monotonic() - killed < 10 * EXIT_WITHIN_S:
                time.sleep(0.02)
            lived = time.monotonic() - killed
            assert not pid_alive(engine_pid), f"{state} engine outlived its frontend"
            assert lived < EXIT_WITHIN_S, f"{state} engine lived {lived:.2f}s after its frontend"
        finally:
            frontend.kill()
            if engine_pid is not None and pid_alive(engine_pid):
                os.kill(engine_pid, signal.SIGKILL)
