"""Clients the frontend uses to talk to an engine core.

    InprocClient   the core in the caller's thread, no IPC (offline `LLM`)
    SyncMPClient   the core in its own process; blocking calls (a reader thread
                   feeds a queue)
    AsyncMPClient  the core in its own process; coroutines (a background
                   asyncio task reads the output socket), for `AsyncLLM`

Death: when the engine process exits unexpectedly (a monitor thread waits on
its sentinel) or reports a crash, every pending `get_output*` and utility
call raises `EngineDeadError`, and so does every later call. Nothing waits
forever on a dead engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import queue
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from paged.scheduler.boundary import EngineCoreOutputs, EngineCoreRequest
from paged.server.engine.errors import EngineDeadError
from paged.server.engine.interfaces import EngineCoreFactory, EngineCoreLike
from paged.server.engine.launch import EngineHandle, EngineProcess, socket_frames
from paged.server.engine.messages import (
    UTILITY_RESULT_TYPES,
    EngineCoreInfo,
    EngineCoreOutputType,
    EngineCoreRequestType,
    EngineErrorMessage,
    UtilityCall,
    UtilityResult,
)
from paged.server.engine.serial import Frame, MsgpackDecoder

_POLL_MS = 100


class EngineCoreClient(Protocol):
    """Blocking access to an engine core (`InprocClient`, `SyncMPClient`)."""

    @property
    def info(self) -> EngineCoreInfo: ...

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: Sequence[str]) -> None: ...

    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (possibly empty for `InprocClient`)."""
        ...

    def call_utility(self, method: str, *args: Any) -> Any: ...

    def shutdown(self) -> None: ...


class AsyncEngineCoreClient(Protocol):
    """Coroutine access to an engine core in another process (`AsyncMPClient`)."""

    @property
    def info(self) -> EngineCoreInfo: ...

    @property
    def dead_error(self) -> EngineDeadError | None: ...

    @property
    def engine_pid(self) -> int:
        """The engine process's pid (on its own node for a remote engine)."""
        ...

    async def add_request_async(self, request: EngineCoreRequest) -> None: ...

    async def abort_requests_async(self, request_ids: Sequence[str]) -> None: ...

    async def get_output_async(self) -> EngineCoreOutputs: ...

    async def call_utility_async(self, method: str, *args: Any) -> Any: ...

    def shutdown(self) -> None: ...


def _check_utility(method: str) -> None:
    if method not in UTILITY_RESULT_TYPES:
        allowed = ", ".join(sorted(UTILITY_RESULT_TYPES))
        raise ValueError(f"method {method!r} is not an engine utility (allowed: {allowed})")


def _merge(outputs: dict[int, EngineCoreOutputs]) -> EngineCoreOutputs:
    if not outputs:
        return EngineCoreOutputs()
    if len(outputs) == 1:
        return next(iter(outputs.values()))
    batches = [outputs[k] for k in sorted(outputs)]
    finished = [r for b in batches for r in (b.finished_requests or [])]
    return msgspec.structs.replace(
        batches[0],
        outputs=[o for b in batches for o in b.outputs],
        finished_requests=finished or None,
    )


class InprocClient:
    """Drives an engine core in the calling thread: `get_output()` runs one step."""

    def __init__(self, core: EngineCoreLike) -> None:
        self.core = core

    @classmethod
    def from_factory(cls, core_factory: EngineCoreFactory) -> InprocClient:
        return cls(core_factory())

    @property
    def info(self) -> EngineCoreInfo:
        return self.core.info

    def add_request(self, request: EngineCoreRequest) -> None:
        """Raises `ValueError` at once for a request the engine can never serve."""
        self.core.add_request(request)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        self.core.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.core.has_work()

    def get_output(self) -> EngineCoreOutputs:
        """Run one engine step; all client indices' outputs merged into one batch."""
        return _merge(self.core.run_step())

    def call_utility(self, method: str, *args: Any) -> Any:
        _check_utility(method)
        return self.core.call_utility(method, args)

    def shutdown(self) -> None:
        self.core.shutdown()


class _OutputDispatch:
    """Decodes output-socket messages; shared by both multiprocess clients."""

    def __init__(self) -> None:
        self.outputs = MsgpackDecoder(EngineCoreOutputs)
        self.utility = MsgpackDecoder(UtilityResult)
        self.error = MsgpackDecoder(EngineErrorMessage)
        self.results = {m: MsgpackDecoder(t) for m, t in UTILITY_RESULT_TYPES.items()}

    def utility_result(self, result: UtilityResult, method: str, frames: Sequence[Frame]) -> Any:
        if result.error is not None and result.value_error:
            raise ValueError(result.error)
        if result.error is not None:
            raise RuntimeError(f"engine utility {method!r} failed: {result.error}")
        return self.results[method].decode_raw(result.result, frames)


class SyncMPClient:
    """Blocking client of an engine core running in its own process."""

    def __init__(self, core_factory: EngineCoreFactory, *, startup_timeout_s: float | None = None):
        self._engine = EngineProcess(core_factory, startup_timeout_s=startup_timeout_s)
        self._dispatch = _OutputDispatch()
        self._outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self._pending: dict[int, tuple[concurrent.futures.Future[Any], str]] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self._dead: EngineDeadError | None = None
        self._stop = threading.Event()
        self._reader = threading.Thread(
            target=self._read_outputs, name="EngineCoreReader", daemon=True
        )
        self._reader.start()
        self._engine.start_monitor(self._on_death)

    @property
    def info(self) -> EngineCoreInfo:
        return self._engine.info

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """Block for the next batch; `TimeoutError` after `timeout` seconds if given."""
        try:
            item = self._outputs.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no engine output within {timeout} s") from None
        if isinstance(item, EngineDeadError):
            self._outputs.put(item)  # wake every other waiter too
            raise item
        return item

    def call_utility(self, method: str, *args: Any) -> Any:
        _check_utility(method)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                raise self._dead
            call_id = next(self._call_ids)
            self._pending[call_id] = (future, method)
        try:
            self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, list(args)))
        except BaseException:
            with self._lock:
                self._pending.pop(call_id, None)
            raise
        return future.result()

    def shutdown(self) -> None:
        self._engine.shutdown()
        self._on_death("engine core client was shut down")
        self._stop.set()
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=2.0)
        self._engine.close()

    def _send(self, kind: EngineCoreRequestType, payload: object) -> None:
        if self._dead is not None:
            raise self._dead
        self._engine.send(kind, payload)

    def _on_death(self, message: str) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = EngineDeadError(message)
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            future.set_exception(self._dead)
        self._outputs.put(self._dead)

    def _read_outputs(self) -> None:
        sock = self._engine.output_socket
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                frames = socket_frames(sock.recv_multipart(copy=False))
                kind = EngineCoreOutputType(bytes(frames[0]))
                if kind is EngineCoreOutputType.OUTPUTS:
                    self._outputs.put(self._dispatch.outputs.decode(frames[1:]))
                elif kind is EngineCoreOutputType.UTILITY_RESULT:
                    self._resolve(frames[1:])
                else:
                    self._on_death(self._dispatch.error.decode(frames[1:]).message)
        except Exception as exc:
            if not self._stop.is_set():
                # Without its reader the client can never answer again.
                self._on_death(f"engine output reader failed: {type(exc).__name__}: {exc}")

    def _resolve(self, frames: Sequence[Frame]) -> None:
        result = self._dispatch.utility.decode(frames)
        with self._lock:
            entry = self._pending.pop(result.call_id, None)
        if entry is None:
            return
        future, method = entry
        try:
            future.set_result(self._dispatch.utility_result(result, method, frames))
        except Exception as exc:
            future.set_exception(exc)


class AsyncMPClient:
    """Asyncio client of an engine core running in its own process.

    Construct it anywhere; the reader task starts on the event loop of the
    first coroutine call, and every coroutine must then run on that loop.
    """

    def __init__(self, core_factory: EngineCoreFactory, *, startup_timeout_s: float | None = None):
        self._setup(EngineProcess(core_factory, startup_timeout_s=startup_timeout_s))

    @classmethod
    def attach(cls, engine: EngineHandle) -> AsyncMPClient:
        """A client of an engine that is already up (e.g. a data-parallel rank on another node)."""
        self = cls.__new__(cls)
        self._setup(engine)
        return self

    def _setup(self, engine: EngineHandle) -> None:
        self._engine: EngineHandle = engine
        self._dispatch = _OutputDispatch()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending: dict[int, tuple[asyncio.Future[Any], str]] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # guards _loop / _death_message across threads
        self._death_message: str | None = None
        self._dead: EngineDeadError | None = None
        self._closed = False
        self._engine.start_monitor(self._on_death_threadsafe)

    @property
    def info(self) -> EngineCoreInfo:
        return self._engine.info

    @property
    def engine_pid(self) -> int:
        """The engine process's pid (on its own node for a remote data-parallel rank)."""
        return self._engine.pid

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Set once the engine is gone (for `/health`); `None` while it serves."""
        if self._dead is None and self._death_message is not None:
            return EngineDeadError(self._death_message)
        return self._dead

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs = self._ensure_started()
        item = await outputs.get()
        if isinstance(item, EngineDeadError):
            outputs.put_nowait(item)  # wake every other waiter too
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        _check_utility(method)
        self._ensure_started()
        assert self._loop is not None
        future: asyncio.Future[Any] = self._loop.create_future()
        call_id = next(self._call_ids)
        self._pending[call_id] = (future, method)
        try:
            self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, list(args)))
        except BaseException:
            self._pending.pop(call_id, None)
            raise
        return await future

    async def check_health_async(self) -> None:
        """Raise `EngineDeadError` if the engine is gone or reports itself unhealthy."""
        if not await self.call_utility_async("is_healthy"):
            raise EngineDeadError("engine core reports itself unhealthy")

    def shutdown(self) -> None:
        """Stop the engine process; safe from any thread, and more than once."""
        if self._closed:
            return
        self._closed = True
        self._engine.shutdown()
        self._on_death_threadsafe("engine core client was shut down")
        task, loop = self._task, self._loop
        if task is not None and loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                task.cancel()
            else:
                asyncio.run_coroutine_threadsafe(_cancel(task), loop).result(timeout=2.0)
        self._engine.close()

    # ---- internals (event-loop thread) ------------------------------------
    def _ensure_started(self) -> asyncio.Queue[EngineCoreOutputs | EngineDeadError]:
        if self._outputs is None:
            loop = asyncio.get_running_loop()
            self._outputs = asyncio.Queue()
            with self._lock:
                self._loop = loop
                message = self._death_message
            if message is not None:
                self._set_dead(message)
            else:
                self._task = loop.create_task(self._read_outputs(), name="EngineCoreReader")
        return self._outputs

    def _send(self, kind: EngineCoreRequestType, payload: object) -> None:
        self._ensure_started()
        if self._dead is not None:
            raise self._dead
        self._engine.send(kind, payload)

    def _on_death_threadsafe(self, message: str) -> None:
        with self._lock:
            if self._death_message is not None:
                return
            self._death_message = message
            loop = self._loop
        if loop is None:
            return  # `_ensure_started` delivers it on first use
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._set_dead(message)
        else:
            # A closed loop raises RuntimeError: nobody is left to wake.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._set_dead, message)

    def _set_dead(self, message: str) -> None:
        if self._dead is not None:
            return
        self._dead = EngineDeadError(message)
        pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(self._dead)
        if self._outputs is not None:
            self._outputs.put_nowait(self._dead)

    async def _read_outputs(self) -> None:
        assert self._outputs is not None
        sock = zmq.asyncio.Socket.from_socket(self._engine.output_socket)
        try:
            while True:
                frames = socket_frames(await sock.recv_multipart(copy=False))
                kind = EngineCoreOutputType(bytes(frames[0]))
                if kind is EngineCoreOutputType.OUTPUTS:
                    self._outputs.put_nowait(self._dispatch.outputs.decode(frames[1:]))
                elif kind is EngineCoreOutputType.UTILITY_RESULT:
                    self._resolve(frames[1:])
                else:
                    message = self._dispatch.error.decode(frames[1:]).message
                    self._on_death_threadsafe(message)
        except (asyncio.CancelledError, zmq.ZMQError):
            if not self._closed:
                self._on_death_threadsafe("engine output socket closed unexpectedly")
        except Exception as exc:
            # Without its reader the client can never answer again.
            self._on_death_threadsafe(f"engine output reader failed: {type(exc).__name__}: {exc}")

    def _resolve(self, frames: Sequence[Frame]) -> None:
        result = self._dispatch.utility.decode(frames)
        entry = self._pending.pop(result.call_id, None)
        if entry is None or entry[0].done():
            return
        future, method = entry
        try:
            future.set_result(self._dispatch.utility_result(result, method, frames))
        except Exception as exc:
            future.set_exception(exc)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
