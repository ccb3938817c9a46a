"""The README's first command, run exactly as written, serves the default model.

The command is read from README.md (the fenced line that runs `paged serve`),
so the README and this test cannot drift apart. Only the leading
`pip install uv &&` is dropped: uv is already installed wherever tests run.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 900.0

pytestmark = pytest.mark.slow


def readme_serve_command() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    commands = [line.strip() for line in lines if re.search(r"\bpaged serve\b", line)]
    commands = [c for c in commands if c.startswith("pip install uv")]
    assert len(commands) == 1, f"README must hold exactly one `paged serve` command: {commands}"
    return commands[0].removeprefix("pip install uv &&").strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_readme_serve_command_answers_a_chat_completion(tmp_path: Path) -> None:
    port = _free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("UV_PROJECT_ENVIRONMENT", "VIRTUAL_ENV")
    }
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            ["bash", "-c", f"{readme_serve_command()} --port {port}"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the whole tree (bash, uv, paged, engine) stops together
        )
        try:
            _wait_healthy(process, port, log_path)
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
            model = client.models.list().data[0].id
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=16,
                temperature=0.0,
            )
            content = reply.choices[0].message.content or ""
            assert "Paris" in content, content
            assert reply.usage is not None and reply.usage.completion_tokens > 0
        finally:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def _wait_healthy(process: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"README command exited early:\n{log_path.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError(
        f"README command did not serve in {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()}"
    )
