"""`EngineProcess`: starts the engine-core process and owns the frontend's sockets.

The frontend binds a ROUTER socket (input) and a PULL socket (output) on
``ipc://`` paths in a private temporary directory, then starts the engine
with `multiprocessing`'s ``spawn`` method (a fresh interpreter: no inherited
threads, locks or CUDA state). The engine connects a DEALER and a PUSH socket
and sends one handshake; `EngineProcess` waits for it while watching the
process, so a startup failure becomes one `EngineStartupError` and an engine
that dies before it is ready never leaves the frontend waiting.

After startup, a monitor thread waits on the process sentinel and reports an
unexpected exit through the `on_death` callback the client registers.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import zmq

from paged.scheduler.boundary import EngineCoreRequest
from paged.server.engine.errors import EngineDeadError, EngineStartupError
from paged.server.engine.interfaces import EngineCoreFactory
from paged.server.engine.messages import EngineCoreInfo, EngineCoreRequestType, EngineHandshake
from paged.server.engine.proc import run_engine_core
from paged.server.engine.serial import (
    Frame,
    MsgpackDecoder,
    MsgpackEncoder,
    encode_add_request,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100
# After the process exits during startup, how long a failure message it sent
# just before may still take to arrive.
_LAST_MESSAGE_GRACE_MS = 500
_SHUTDOWN_GRACE_S = 5.0


class EngineHandle(Protocol):
    """The frontend's end of one engine core, whatever runs it (what the clients drive).

    `EngineProcess` (a local process it started) and `dp_remote.RemoteEngine`
    (an engine another node started, over TCP) satisfy it.
    """

    info: EngineCoreInfo
    output_socket: zmq.Socket[Any]

    @property
    def pid(self) -> int:
        """The engine process's pid (on its own node for a remote engine)."""
        ...

    def send(self, kind: EngineCoreRequestType, payload: object = None) -> None:
        """Deliver one message; `EngineDeadError` if it cannot be."""
        ...

    def start_monitor(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(message)` from a thread once the engine is gone (before `shutdown`)."""
        ...

    def shutdown(self) -> None:
        """Make the engine stop; idempotent."""
        ...

    def close(self) -> None:
        """Release the sockets (after `shutdown`)."""
        ...


class EngineProcess:
    """One engine-core process with its frontend-side sockets.

    Thread-safety: `send` may be called from any thread (it takes a lock);
    `output_socket` belongs to the one reader the client runs.
    """

    def __init__(self, core_factory: EngineCoreFactory, *, startup_timeout_s: float | None = None):
        if startup_timeout_s is not None and startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        self._tmpdir = tempfile.mkdtemp(prefix="paged-engine-")
        self._ctx = zmq.Context()
        self.input_socket = self._ctx.socket(zmq.ROUTER)
        # Raise instead of silently dropping messages for a vanished engine.
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(f"ipc://{self._tmpdir}/input.sock")
        self.output_socket = self._ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(f"ipc://{self._tmpdir}/output.sock")
        self._identity = uuid.uuid4().bytes
        self._send_lock = threading.Lock()
        self._encoder = MsgpackEncoder()
        self._closing = False
        self._monitor: threading.Thread | None = None
        self._stop_monitor_r, self._stop_monitor_w = multiprocessing.Pipe(duplex=False)
        ctx = multiprocessing.get_context("spawn")
        self.process: BaseProcess = ctx.Process(
            target=run_engine_core,
            name="EngineCore",
            kwargs={
                "core_factory": core_factory,
                "input_address": f"ipc://{self._tmpdir}/input.sock",
                "output_address": f"ipc://{self._tmpdir}/output.sock",
                "identity": self._identity,
                "log_level": logging.getLogger("paged").getEffectiveLevel(),
            },
        )
        self.process.start()
        # Kill the process and remove the socket directory even if the client
        # is dropped without `shutdown()` (also runs at interpreter exit).
        self._finalizer = weakref.finalize(self, _kill_and_clean, self.process, self._tmpdir)
        try:
            self.info = self._wait_for_handshake(startup_timeout_s)
        except BaseException:
            self.shutdown()
            self.close()
            raise
        logger.info(
            "engine core ready (pid %s): %d KV blocks of %d tokens, max_model_len %d",
            self.process.pid,
            self.info.num_gpu_blocks,
            self.info.block_size,
            self.info.max_model_len,
        )

    @property
    def pid(self) -> int:
        return self.process.pid or 0

    def _wait_for_handshake(self, timeout_s: float | None) -> EngineCoreInfo:
        decoder = MsgpackDecoder(EngineHandshake)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.input_socket.poll(_POLL_MS):
                frames = self.input_socket.recv_multipart(copy=False)
                if frames[1].bytes != EngineCoreRequestType.HANDSHAKE.value:
                    continue
                handshake = decoder.decode([f.buffer for f in frames[2:]])
                break
            if not self.process.is_alive():
                if self.input_socket.poll(_LAST_MESSAGE_GRACE_MS):
                    continue
                raise EngineStartupError(
                    f"engine core process exited with code {self.process.exitcode} "
                    "before it was ready (see its log above)"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise EngineStartupError(f"engine core was not ready within {timeout_s} s")
        if not handshake.ok or handshake.info is None:
            raise EngineStartupError(
                f"engine core failed to start: {handshake.error_type}: {handshake.error_message}",
                engine_traceback=handshake.traceback,
            )
        return handshake.info

    def start_monitor(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(message)` from a thread if the process exits before `shutdown`."""
        self._monitor = threading.Thread(
            target=self._watch, args=(on_death,), name="EngineCoreMonitor", daemon=True
        )
        self._monitor.start()

    def _watch(self, on_death: Callable[[str], None]) -> None:
        ready = multiprocessing.connection.wait([self.process.sentinel, self._stop_monitor_r])
        if self.process.sentinel in ready and not self._closing:
            self.process.join(timeout=1.0)
            on_death(
                f"engine core process (pid {self.process.pid}) died unexpectedly "
                f"with exit code {self.process.exitcode}"
            )

    def send(self, kind: EngineCoreRequestType, payload: object = None) -> None:
        """Send one message to the engine; `EngineDeadError` if it cannot be delivered."""
        with self._send_lock:  # also guards the encoder, which is not thread-safe
            frames: list[Frame] = []
            if isinstance(payload, EngineCoreRequest):
                frames = encode_add_request(self._encoder, payload)
            elif payload is not None:
                frames = self._encoder.encode(payload)
            if self._closing:
                raise EngineDeadError("engine core client was shut down")
            try:
                self.input_socket.send_multipart([self._identity, kind.value, *frames], copy=False)
            except zmq.ZMQError as exc:
                raise EngineDeadError(f"cannot reach the engine core: {exc}") from exc

    def shutdown(self) -> None:
        """Ask the engine to stop, then terminate or kill it if it does not."""
        with self._send_lock:
            if self._closing:
                return
            self._closing = True
            if self.process.is_alive():
                # Not connected (yet, or any more): terminated below instead.
                with contextlib.suppress(zmq.ZMQError):
                    self.input_socket.send_multipart(
                        [self._identity, EngineCoreRequestType.SHUTDOWN.value], copy=False
                    )
        self.process.join(timeout=_SHUTDOWN_GRACE_S)
        for stop in (self.process.terminate, self.process.kill):
            if not self.process.is_alive():
                break
            stop()
            self.process.join(timeout=_SHUTDOWN_GRACE_S)
        self._stop_monitor_w.send(None)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=1.0)

    def close(self) -> None:
        """Close the sockets and remove the socket directory (after `shutdown`)."""
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self._ctx.term()
        self._stop_monitor_r.close()
        self._stop_monitor_w.close()
        self._finalizer()


def _kill_and_clean(process: BaseProcess, tmpdir: str) -> None:
    if process.is_alive():
        process.kill()
        process.join(timeout=_SHUTDOWN_GRACE_S)
    if os.path.isdir(tmpdir):
        shutil.rmtree(tmpdir, ignore_errors=True)


def socket_frames(frames: list[Any]) -> list[Frame]:
    """The buffers of `recv_multipart(copy=False)` frames, without copying."""
    return [f.buffer for f in frames]
