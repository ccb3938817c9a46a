"""Worker-side tier storage: host memory, a directory of chunk files, a background writer.

The worker never decides what to keep; it executes the scheduler side's
puts and evictions in the order they were issued. Saves and evictions run on
one background thread (`ChunkWriter`) so a step only pays for the
device->host copy; a load waits only for queued operations on its own keys.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paged.connectors.kv.offloading.chunks import (
    ChunkError,
    ChunkKey,
    Fingerprint,
    decode_chunk,
    encode_chunk,
)

logger = logging.getLogger(__name__)

CHUNK_SUFFIX = ".kvchunk"


@dataclass
class TierCounters:
    """Bytes and seconds moved by one tier, since the last `take`."""

    bytes_saved: int = 0
    seconds_saved: float = 0.0
    bytes_loaded: int = 0
    seconds_loaded: float = 0.0


class HostStore:
    """Chunks in host memory, as CPU tensors in the cross-layer layout (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks: dict[ChunkKey, torch.Tensor] = {}

    def put(self, key: ChunkKey, chunk: torch.Tensor) -> None:
        with self._lock:
            self._chunks[key] = chunk

    def get(self, key: ChunkKey) -> torch.Tensor:
        with self._lock:
            chunk = self._chunks.get(key)
        if chunk is None:
            raise ChunkError(f"chunk {key[:16]} is not in host memory")
        return chunk

    def evict(self, key: ChunkKey) -> None:
        with self._lock:
            self._chunks.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._chunks)


class DiskStore:
    """One file per chunk under `path`, written to a temporary name and renamed."""

    def __init__(self, path: Path, fingerprint: Fingerprint) -> None:
        self.path = path
        self.fingerprint = fingerprint
        path.mkdir(parents=True, exist_ok=True)

    def file_of(self, key: ChunkKey) -> Path:
        return self.path / f"{key}{CHUNK_SUFFIX}"

    def put(self, key: ChunkKey, chunk: torch.Tensor) -> int:
        """Write the chunk; returns the bytes written."""
        data = encode_chunk(self.fingerprint, _as_bytes(chunk))
        target = self.file_of(key)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
        return len(data)

    def get(self, key: ChunkKey, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Read and verify a chunk; `ChunkError` if missing, truncated, foreign or corrupt."""
        target = self.file_of(key)
        try:
            size = target.stat().st_size
            buf = bytearray(size)  # writable, so torch.frombuffer shares it without a copy
            with open(target, "rb") as f:
                read = f.readinto(buf)
        except OSError as exc:
            raise ChunkError(f"chunk file {target.name} unreadable: {exc}") from exc
        payload = decode_chunk(memoryview(buf)[:read], self.fingerprint)
        expected = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        if len(payload) != expected:
            raise ChunkError(f"chunk file {target.name}: {len(payload)} bytes, want {expected}")
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(shape)

    def evict(self, key: ChunkKey) -> None:
        self.file_of(key).unlink(missing_ok=True)


def scan_disk(path: Path) -> list[tuple[ChunkKey, int]]:
    """Chunk files under `path`, least recently written first: (key, bytes).

    This is how a restarted engine finds its disk tier again; file contents are
    verified only when loaded (a bad file is then a load error).
    """
    if not path.is_dir():
        return []
    found: list[tuple[float, ChunkKey, int]] = []
    for entry in os.scandir(path):
        if not entry.name.endswith(CHUNK_SUFFIX) or entry.name.startswith("."):
            continue
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        found.append((st.st_mtime, ChunkKey(entry.name[: -len(CHUNK_SUFFIX)]), st.st_size))
    found.sort()
    return [(key, size) for _, key, size in found]


@dataclass
class _Put:
    key: ChunkKey
    chunk: torch.Tensor
    to_host: bool
    to_disk: bool


@dataclass
class _Evict:
    key: ChunkKey
    host: bool
    disk: bool


@dataclass
class _Stop:
    done: threading.Event = field(default_factory=threading.Event)


class ChunkWriter:
    """Runs puts and evictions on one background thread, in submission order."""

    def __init__(self, host: HostStore | None, disk: DiskStore | None) -> None:
        self.host = host
        self.disk = disk
        self.host_counters = TierCounters()
        self.disk_counters = TierCounters()
        self._queue: queue.Queue[_Put | _Evict | _Stop] = queue.Queue()
        self._cond = threading.Condition()
        self._pending: defaultdict[ChunkKey, int] = defaultdict(int)
        self._thread = threading.Thread(target=self._run, name="paged-kv-offload", daemon=True)
        self._thread.start()

    def put(self, key: ChunkKey, chunk: torch.Tensor, *, to_host: bool, to_disk: bool) -> None:
        self._submit(_Put(key, chunk, to_host, to_disk))

    def evict(self, key: ChunkKey, *, host: bool, disk: bool) -> None:
        self._submit(_Evict(key, host, disk))

    def _submit(self, op: _Put | _Evict) -> None:
        with self._cond:
            self._pending[op.key] += 1
        self._queue.put(op)

    def wait_for(self, key: ChunkKey) -> None:
        """Block until every operation queued on `key` so far has run."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending.get(key, 0) == 0)

    def flush(self) -> None:
        """Block until the queue is empty (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        stop = _Stop()
        self._queue.put(stop)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            try:
                if isinstance(op, _Stop):
                    return
                self._execute(op)
            except Exception:  # a failed write is a later miss, never a dead engine
                logger.exception("KV offload: %s of chunk %s failed", type(op).__name__, op)
            finally:
                if not isinstance(op, _Stop):
                    with self._cond:
                        self._pending[op.key] -= 1
                        if self._pending[op.key] == 0:
                            del self._pending[op.key]
                        self._cond.notify_all()
                self._queue.task_done()

    def _execute(self, op: _Put | _Evict) -> None:
        if isinstance(op, _Evict):
            if op.host and self.host is not None:
                self.host.evict(op.key)
            if op.disk and self.disk is not None:
                self.disk.evict(op.key)
            return
        nbytes = op.chunk.numel() * op.chunk.element_size()
        if op.to_host and self.host is not None:
            self.host.put(op.key, op.chunk)
            with self._cond:
                self.host_counters.bytes_saved += nbytes
        if op.to_disk and self.disk is not None:
            start = time.perf_counter()
            written = self.disk.put(op.key, op.chunk)
            with self._cond:
                self.disk_counters.bytes_saved += written
                self.disk_counters.seconds_saved += time.perf_counter() - start

    def take_counters(self) -> tuple[TierCounters, TierCounters]:
        """(host, disk) save counters since the last call."""
        with self._cond:
            host, disk = self.host_counters, self.disk_counters
            self.host_counters, self.disk_counters = TierCounters(), TierCounters()
        return host, disk


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _as_bytes(chunk: torch.Tensor) -> memoryview:
    flat = chunk.contiguous().view(torch.uint8).reshape(-1)
    return memoryview(flat.numpy().data)  # the tensor's own bytes, no copy
