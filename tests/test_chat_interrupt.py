"""`paged chat` in a real subprocess: Ctrl-C stops a reply, not the chat.

SIGINT goes to the whole process group, as a terminal sends it. After the
first one the chat must print the prompt again and answer the next message
(`LLM.stream` refuses to start while a request is in flight, so an answer
also proves the stopped request was aborted); a Ctrl-C at the prompt ends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.slow


class _Output:
    """Collects a pipe's text on a thread so the test can wait for markers."""

    def __init__(self, stream: object) -> None:
        self.text = ""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: object) -> None:
        read = stream.read  # type: ignore[attr-defined]
        while chunk := read(1):
            with self._lock:
                self.text += chunk

    def join(self) -> None:
        self._thread.join(timeout=30)

    def wait_for(self, marker: str, after: int, timeout: float) -> int:
        """Index just past the first `marker` found at or after `after`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = self.text.find(marker, after)
            if found >= 0:
                return found + len(marker)
            time.sleep(0.05)
        raise AssertionError(f"{marker!r} not seen after {after} in:\n{self.text}")


def _sigint(disposition: signal.Handlers) -> None:
    signal.signal(signal.SIGINT, disposition)


@pytest.mark.parametrize(
    ("engine_args", "inherited"),
    [
        # Started as a shell's background job (or by nohup): SIGINT comes in ignored,
        # and Python then installs no KeyboardInterrupt handler of its own.
        pytest.param([], signal.SIG_IGN, id="in-process-sigint-ignored"),
        # Worker processes share the terminal's process group: they must survive it too.
        pytest.param(["--pipeline-parallel-size", "2"], signal.SIG_DFL, id="mp-workers"),
    ],
)
def test_ctrl_c_stops_the_reply_then_ctrl_c_at_the_prompt_quits(
    engine_args: list[str], inherited: signal.Handlers
) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "paged.server.cli", "--log-level", "warning", "chat"]
    process = subprocess.Popen(
        [*command, *engine_args, "--max-tokens", "4000", "--max-model-len", "4096"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: _sigint(inherited),
    )
    assert process.stdin is not None
    out = _Output(process.stdout)
    try:
        pos = out.wait_for("you> ", 0, timeout=300)
        process.stdin.write("Write a very long story about a dragon, with many chapters.\n")
        process.stdin.flush()
        reply_start = out.wait_for("model> ", pos, timeout=60)
        out.wait_for(" ", reply_start + 20, timeout=60)  # the reply is streaming
        os.killpg(process.pid, signal.SIGINT)
        pos = out.wait_for(" [stopped]\nyou> ", reply_start, timeout=30)
        assert process.poll() is None, out.text

        process.stdin.write("What is the capital of France?\n")
        process.stdin.flush()
        pos = out.wait_for("you> ", out.wait_for("model> ", pos, timeout=30), timeout=120)
        assert "Paris" in out.text[out.text.rfind("model> ") :], out.text

        os.killpg(process.pid, signal.SIGINT)  # at the prompt: quit
        # Exiting shuts the engine down (and, with -pp 2, its worker processes): seconds on
        # a quiet machine, over a minute seen on a loaded 2-core CI box.
        assert process.wait(timeout=240) == 130, out.text
        assert "Traceback" not in out.text, out.text
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        process.stdin.close()
        out.join()
        process.stdout.close()  # type: ignore[union-attr]
