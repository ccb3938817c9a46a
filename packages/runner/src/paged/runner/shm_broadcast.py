"""A one-writer, N-reader broadcast queue over shared memory, with a ZMQ fallback.

Layout of the shared segment (seed: MultiprocExecutor のプロセス間通信):

    +-----------------------------------------+--------------------------------------+
    | data: chunk 0 | chunk 1 | ... | chunk C-1 | flags: [written, r0, r1, ...] x C    |
    +-----------------------------------------+--------------------------------------+

A chunk holds an 8-byte signed length then the payload. The writer fills
chunk i only when every reader has read its previous content (all reader
flags set, or never written); it writes the payload, clears the reader flags,
then sets `written`. Reader r takes chunk i when `written` is set and its own
flag is clear, copies the payload out, then sets its flag. Writer and readers
walk the chunks in the same order, so messages arrive in order.

A payload larger than a chunk goes over a ZMQ PUB socket instead; the chunk
then carries length -1 as a marker telling readers to take the next message
from their SUB socket. The writer binds an XPUB socket and, before its first
overflow send, waits until all readers have subscribed (a PUB socket drops
messages sent before a subscriber connects).

Waiting polls with a short sleep (the CPUs are shared), bounded by a timeout
so callers can check that the other side is still alive.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import msgspec
import zmq

_LEN = struct.Struct("<q")
_OVERFLOW = -1


class QueueHandle(msgspec.Struct, array_like=True, frozen=True):
    """What another process needs to attach to a queue."""

    shm_name: str
    n_readers: int
    n_chunks: int
    chunk_bytes: int
    zmq_address: str


@dataclass
class _Layout:
    n_readers: int
    n_chunks: int
    chunk_bytes: int

    @property
    def meta_offset(self) -> int:
        return self.n_chunks * self.chunk_bytes

    @property
    def meta_stride(self) -> int:
        return 1 + self.n_readers

    @property
    def total(self) -> int:
        return self.meta_offset + self.n_chunks * self.meta_stride


class MessageQueue:
    """Create with `MessageQueue.create(...)` (the writer side owns the segment)."""

    def __init__(
        self,
        handle: QueueHandle,
        shm: shared_memory.SharedMemory,
        *,
        writer: bool,
        reader_rank: int | None,
        owner: bool,
    ) -> None:
        self.handle = handle
        self._shm = shm
        if shm.buf is None:
            raise RuntimeError(f"shared memory segment {handle.shm_name} is closed")
        self._buf: memoryview = shm.buf
        self._layout = _Layout(handle.n_readers, handle.n_chunks, handle.chunk_bytes)
        self._writer = writer
        self._reader_rank = reader_rank
        self._owner = owner
        self._index = 0
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._subscribed = 0
        self._socket: zmq.Socket[bytes]
        if writer:
            self._socket = self._ctx.socket(zmq.XPUB)
            self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)
            self._socket.setsockopt(zmq.SNDHWM, 0)
            self._socket.bind(handle.zmq_address)
        else:
            self._socket = self._ctx.socket(zmq.SUB)
            self._socket.setsockopt(zmq.SUBSCRIBE, b"")
            self._socket.setsockopt(zmq.RCVHWM, 0)
            self._socket.connect(handle.zmq_address)

    # ----------------------------------------------------------- creation

    @staticmethod
    def make_handle(n_readers: int, n_chunks: int = 8, chunk_bytes: int = 1 << 22) -> QueueHandle:
        """Reserve a fresh segment and address; `create` then makes the segment."""
        if n_readers < 1 or n_chunks < 1 or chunk_bytes < _LEN.size + 1:
            raise ValueError(
                f"n_readers, n_chunks must be >= 1 and chunk_bytes > 8, got "
                f"{n_readers}, {n_chunks}, {chunk_bytes}"
            )
        name = f"paged_mq_{uuid.uuid4().hex[:16]}"
        address = f"ipc://{tempfile.gettempdir()}/{name}.sock"
        return QueueHandle(name, n_readers, n_chunks, chunk_bytes, address)

    @classmethod
    def create_segment(cls, handle: QueueHandle) -> shared_memory.SharedMemory:
        layout = _Layout(handle.n_readers, handle.n_chunks, handle.chunk_bytes)
        shm = shared_memory.SharedMemory(name=handle.shm_name, create=True, size=layout.total)
        assert shm.buf is not None  # freshly created
        shm.buf[layout.meta_offset : layout.total] = bytes(layout.total - layout.meta_offset)
        return shm

    @classmethod
    def create_writer(cls, handle: QueueHandle) -> MessageQueue:
        """The segment is created here; this side unlinks it on `close()`."""
        return cls(handle, cls.create_segment(handle), writer=True, reader_rank=None, owner=True)

    @classmethod
    def create_reader(cls, handle: QueueHandle, rank: int) -> MessageQueue:
        """Create the segment as a reader (for response queues whose writer starts later)."""
        return cls(handle, cls.create_segment(handle), writer=False, reader_rank=rank, owner=True)

    @classmethod
    def attach(
        cls, handle: QueueHandle, *, writer: bool, reader_rank: int | None = None
    ) -> MessageQueue:
        """Attach to an existing segment created by another process."""
        if not writer and (reader_rank is None or not 0 <= reader_rank < handle.n_readers):
            raise ValueError(f"reader_rank must be in [0, {handle.n_readers}), got {reader_rank}")
        # Attaching registers the name with the resource tracker again; the
        # tracker is the creator's (spawned children inherit it), so this is
        # idempotent and only the creator's `close()` unlinks the segment.
        shm = shared_memory.SharedMemory(name=handle.shm_name)
        return cls(handle, shm, writer=writer, reader_rank=reader_rank, owner=False)

    # ------------------------------------------------------------- flags

    def _flag(self, chunk: int, slot: int) -> int:
        return self._buf[self._layout.meta_offset + chunk * self._layout.meta_stride + slot]

    def _set_flag(self, chunk: int, slot: int, value: int) -> None:
        self._buf[self._layout.meta_offset + chunk * self._layout.meta_stride + slot] = value

    def _chunk_free(self, chunk: int) -> bool:
        if not self._flag(chunk, 0):
            return True
        return all(self._flag(chunk, 1 + r) for r in range(self._layout.n_readers))

    @staticmethod
    def _wait(ready: Callable[[], object], deadline: float | None) -> bool:
        spins = 0
        while not ready():
            if deadline is not None and time.monotonic() > deadline:
                return False
            spins += 1
            time.sleep(0 if spins < 64 else 2e-4)
        return True

    # --------------------------------------------------------------- I/O

    def enqueue(self, payload: bytes, timeout: float | None = None) -> None:
        """Broadcast `payload` to every reader (raises TimeoutError if no chunk frees up)."""
        if not self._writer:
            raise RuntimeError("enqueue on a reader side of a MessageQueue")
        chunk = self._index
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._wait(lambda: self._chunk_free(chunk), deadline):
            raise TimeoutError("message queue full: a reader stopped reading")
        start = chunk * self._layout.chunk_bytes
        if len(payload) + _LEN.size <= self._layout.chunk_bytes:
            _LEN.pack_into(self._buf, start, len(payload))
            self._buf[start + _LEN.size : start + _LEN.size + len(payload)] = payload
        else:
            _LEN.pack_into(self._buf, start, _OVERFLOW)
            self._wait_subscribers(deadline)
            self._socket.send(payload, copy=False)
        for r in range(self._layout.n_readers):
            self._set_flag(chunk, 1 + r, 0)
        self._set_flag(chunk, 0, 1)  # publish last
        self._index = (chunk + 1) % self._layout.n_chunks

    def _wait_subscribers(self, deadline: float | None) -> None:
        while self._subscribed < self._layout.n_readers:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            timeout_ms = -1 if remaining is None else int(remaining * 1000)
            if not self._socket.poll(timeout_ms):
                raise TimeoutError("message queue: readers never subscribed to the overflow socket")
            if self._socket.recv()[:1] == b"\x01":
                self._subscribed += 1

    def dequeue(self, timeout: float | None = None) -> bytes:
        """Next message for this reader (raises TimeoutError when none arrives in time)."""
        if self._writer or self._reader_rank is None:
            raise RuntimeError("dequeue on the writer side of a MessageQueue")
        chunk, slot = self._index, 1 + self._reader_rank
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._wait(lambda: self._flag(chunk, 0) and not self._flag(chunk, slot), deadline):
            raise TimeoutError("no message")
        start = chunk * self._layout.chunk_bytes
        (length,) = _LEN.unpack_from(self._buf, start)
        if length == _OVERFLOW:
            data = self._socket.recv()
        else:
            data = bytes(self._buf[start + _LEN.size : start + _LEN.size + length])
        self._set_flag(chunk, slot, 1)
        self._index = (chunk + 1) % self._layout.n_chunks
        return data

    def close(self) -> None:
        self._socket.close(linger=0)
        self._buf = memoryview(b"")
        self._shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
            # The ipc socket file, whichever side bound it.
            path = self.handle.zmq_address.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)
