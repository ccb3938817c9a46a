"""Processor caches: a repeated item is not processed or sent again (seed: プロセッサキャッシュ).

Four modes, chosen by vLLM's `--mm-processor-cache-type` / `--mm-processor-cache-gb`
(a size of 0 means `none`, as in vLLM):

    none            every item is processed and its tensors sent with the request
    processor_only  P0 keeps the processed tensors (LRU by bytes); a hit skips the
                    HF processor, the tensors still travel over ZMQ
    lru             P0 keeps only the *sizes* of what it sent; P1 (the engine core)
                    keeps the tensors in a mirror with the same capacity and the same
                    update order, so it evicts exactly what P0 evicts. A hit sends
                    `data=None` and P1 fills the tensors back in
    shm             P0 writes the tensors once to a POSIX shared-memory segment per item
                    and always sends `data=None`; P1 reads the segment

Order is the whole trick of `lru` (the seed's "同一のEviction順序"): P0 may
*look* (`is_cached`, no reordering) while it processes, but it *updates*
(`commit`) only in the order the requests are sent, immediately before each
send; P1 updates in arrival order, first thing, before any validation can
reject the request. Both sides then run the same LRU operations in the same
order, so P1 holds an item exactly when P0 believes it does.
"""

from __future__ import annotations

import contextlib
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Generic, Literal, TypeVar

import msgspec

from paged.multimodal.inputs import MultiModalFeatureSpec, TensorData

ProcessorCacheType = Literal["none", "processor_only", "lru", "shm"]
PROCESSOR_CACHE_TYPES: tuple[ProcessorCacheType, ...] = ("none", "processor_only", "lru", "shm")
GIB = 1 << 30

ItemData = dict[str, TensorData]
# Recomputes an item's tensors when P0 finds at commit time that a hit it
# counted on while processing was evicted in between (by another request).
Reprocess = Callable[[int], ItemData]

V = TypeVar("V")


class ProcessorCacheError(ValueError):
    """P1 was sent an item without data that it does not hold (caches out of step)."""


def item_nbytes(data: ItemData) -> int:
    """Bytes an item occupies in a cache: its tensor payloads."""
    return sum(len(t.data) for t in data.values())


class ByteLRU(Generic[V]):
    """An LRU map bounded by the byte size of its values (sizes given by the caller).

    Order invariant: iteration order is recency, oldest first; `touch` and
    `put` move a key to the end; eviction pops from the front until the new
    entry fits. An entry larger than the whole capacity is never stored.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self.num_hits = 0
        self.num_queries = 0

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, key: str) -> V | None:
        """The value without changing recency (P0's look-only query)."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def touch(self, key: str) -> V | None:
        """The value, made most recent; None if absent. Counts a query (and a hit)."""
        self.num_queries += 1
        entry = self._entries.get(key)
        if entry is None:
            return None
        self.num_hits += 1
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, value: V, size: int) -> list[tuple[str, V]]:
        """Store (or refresh) `key`; returns the entries evicted to make room."""
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old[1]
        evicted: list[tuple[str, V]] = []
        if size > self.capacity_bytes:
            return evicted
        while self.used_bytes + size > self.capacity_bytes:
            k, (v, s) = self._entries.popitem(last=False)
            self.used_bytes -= s
            evicted.append((k, v))
        self._entries[key] = (value, size)
        self.used_bytes += size
        return evicted

    def keys(self) -> list[str]:
        """Keys, oldest first."""
        return list(self._entries)

    def clear(self) -> list[tuple[str, V]]:
        gone = [(k, v) for k, (v, _) in self._entries.items()]
        self._entries.clear()
        self.used_bytes = 0
        return gone

    def check_integrity(self) -> None:
        assert self.used_bytes == sum(s for _, s in self._entries.values())
        assert 0 <= self.used_bytes <= self.capacity_bytes


# ---------------------------------------------------------------------- P0 (frontend)
class SenderCache:
    """P0's side. Subclasses decide what a hit saves; this base is mode `none`."""

    mode: ProcessorCacheType = "none"

    def cached_data(self, mm_hash: str) -> ItemData | None:
        """Tensors P0 can reuse without processing (look only; `processor_only`)."""
        return None

    def is_cached(self, mm_hash: str) -> bool:
        """Whether processing may be skipped for `mm_hash` (look only, no reordering)."""
        return False

    def commit(
        self, features: Sequence[MultiModalFeatureSpec], reprocess: Reprocess
    ) -> list[MultiModalFeatureSpec]:
        """Update the cache in send order; returns the features to send (data may be None).

        A feature passed with `data=None` was a hit when it was processed; if it
        is no longer cached, `reprocess(index)` supplies its tensors.
        """
        return [_with_data(f, i, reprocess) for i, f in enumerate(features)]

    def hit_rate(self) -> tuple[int, int]:
        """(hits, queries) of `commit` so far."""
        return 0, 0

    def close(self) -> None:
        """Release what the cache holds outside the process (shm segments)."""


def _with_data(
    feature: MultiModalFeatureSpec, index: int, reprocess: Reprocess
) -> MultiModalFeatureSpec:
    if feature.data is not None:
        return feature
    return msgspec.structs.replace(feature, data=reprocess(index))


class ProcessorOnlySenderCache(SenderCache):
    """Keeps processed tensors in P0; they are sent with every request."""

    mode: ProcessorCacheType = "processor_only"

    def __init__(self, capacity_bytes: int) -> None:
        self.lru: ByteLRU[ItemData] = ByteLRU(capacity_bytes)

    def cached_data(self, mm_hash: str) -> ItemData | None:
        return self.lru.peek(mm_hash)

    def is_cached(self, mm_hash: str) -> bool:
        return mm_hash in self.lru

    def commit(
        self, features: Sequence[MultiModalFeatureSpec], reprocess: Reprocess
    ) -> list[MultiModalFeatureSpec]:
        out: list[MultiModalFeatureSpec] = []
        for i, feature in enumerate(features):
            data = self.lru.touch(feature.identifier)
            if data is None:
                feature = _with_data(feature, i, reprocess)
                assert feature.data is not None
                self.lru.put(feature.identifier, feature.data, item_nbytes(feature.data))
            elif feature.data is None:
                feature = msgspec.structs.replace(feature, data=data)
            out.append(feature)
        return out

    def hit_rate(self) -> tuple[int, int]:
        return self.lru.num_hits, self.lru.num_queries


class LRUSenderCache(SenderCache):
    """Keeps only sizes in P0; P1's `MirrorReceiverCache` keeps the tensors."""

    mode: ProcessorCacheType = "lru"

    def __init__(self, capacity_bytes: int) -> None:
        self.lru: ByteLRU[None] = ByteLRU(capacity_bytes)

    def is_cached(self, mm_hash: str) -> bool:
        return mm_hash in self.lru

    def commit(
        self, features: Sequence[MultiModalFeatureSpec], reprocess: Reprocess
    ) -> list[MultiModalFeatureSpec]:
        out: list[MultiModalFeatureSpec] = []
        for i, feature in enumerate(features):
            if mm_hash_hit(self.lru, feature.identifier):
                out.append(msgspec.structs.replace(feature, data=None))
                continue
            feature = _with_data(feature, i, reprocess)
            assert feature.data is not None
            self.lru.put(feature.identifier, None, item_nbytes(feature.data))
            out.append(feature)
        return out

    def hit_rate(self) -> tuple[int, int]:
        return self.lru.num_hits, self.lru.num_queries


def mm_hash_hit(lru: ByteLRU[V], mm_hash: str) -> bool:
    """`touch` as a yes/no (values may be None in the sender's size-only map)."""
    if mm_hash not in lru:
        lru.num_queries += 1
        return False
    lru.touch(mm_hash)
    return True


_SHM_DECODER = msgspec.msgpack.Decoder(dict[str, TensorData])
_LEN = struct.Struct("<Q")
# Segments this process created: when P0 and P1 share a process (offline LLM),
# the reader must leave their resource-tracker registration alone.
_CREATED_HERE: set[str] = set()


def shm_segment_name(prefix: str, mm_hash: str) -> str:
    """The segment holding `mm_hash` for the server whose segments start with `prefix`."""
    return f"{prefix}{mm_hash[:40]}"


class ShmSenderCache(SenderCache):
    """Writes each new item to its own shared-memory segment; always sends `data=None`.

    Segments are named `prefix + hash` (the prefix is random per server, so
    two servers on one host never share), evicted LRU by bytes (unlinked),
    and all unlinked by `close()`. P1 reads a segment when the request
    arrives; an item evicted before P1 read it fails that request with a
    clear error (only possible when the cache is smaller than what requests
    in flight hold).
    """

    mode: ProcessorCacheType = "shm"

    def __init__(self, capacity_bytes: int, prefix: str | None = None) -> None:
        self.prefix = prefix if prefix is not None else new_shm_prefix()
        self.lru: ByteLRU[shared_memory.SharedMemory] = ByteLRU(capacity_bytes)
        self._encoder = msgspec.msgpack.Encoder()

    def is_cached(self, mm_hash: str) -> bool:
        return mm_hash in self.lru

    def commit(
        self, features: Sequence[MultiModalFeatureSpec], reprocess: Reprocess
    ) -> list[MultiModalFeatureSpec]:
        out: list[MultiModalFeatureSpec] = []
        for i, feature in enumerate(features):
            if not mm_hash_hit(self.lru, feature.identifier):
                feature = _with_data(feature, i, reprocess)
                assert feature.data is not None
                payload = self._encoder.encode(feature.data)
                if len(payload) > self.lru.capacity_bytes:
                    out.append(feature)  # too large to cache: send it inline
                    continue
                segment = self._write(feature.identifier, payload)
                for _, old in self.lru.put(feature.identifier, segment, len(payload)):
                    _unlink(old)
            out.append(msgspec.structs.replace(feature, data=None))
        return out

    def _write(self, mm_hash: str, payload: bytes) -> shared_memory.SharedMemory:
        name = shm_segment_name(self.prefix, mm_hash)
        # Layout: u64 payload length, then the msgpack payload (segments are page-padded).
        segment = shared_memory.SharedMemory(name=name, create=True, size=_LEN.size + len(payload))
        _CREATED_HERE.add(name)
        buf = _buffer(segment)
        _LEN.pack_into(buf, 0, len(payload))
        buf[_LEN.size : _LEN.size + len(payload)] = payload
        return segment

    def hit_rate(self) -> tuple[int, int]:
        return self.lru.num_hits, self.lru.num_queries

    def close(self) -> None:
        for _, segment in self.lru.clear():
            _unlink(segment)


def _buffer(segment: shared_memory.SharedMemory) -> memoryview:
    buf = segment.buf
    if buf is None:
        raise ProcessorCacheError(f"shared-memory segment {segment.name!r} is closed")
    return buf


def _unlink(segment: shared_memory.SharedMemory) -> None:
    _CREATED_HERE.discard(segment.name)
    segment.close()
    with contextlib.suppress(FileNotFoundError):
        segment.unlink()


def new_shm_prefix() -> str:
    return f"pgmm_{secrets.token_hex(4)}_"


def make_sender_cache(
    cache_type: str, cache_gb: float, *, shm_prefix: str | None = None
) -> SenderCache:
    """P0's cache for vLLM's `--mm-processor-cache-type` / `--mm-processor-cache-gb`."""
    mode = _check_mode(cache_type, cache_gb)
    capacity = int(cache_gb * GIB)
    if mode == "processor_only":
        return ProcessorOnlySenderCache(capacity)
    if mode == "lru":
        return LRUSenderCache(capacity)
    if mode == "shm":
        return ShmSenderCache(capacity, shm_prefix)
    return SenderCache()


def _check_mode(cache_type: str, cache_gb: float) -> ProcessorCacheType:
    if cache_type not in PROCESSOR_CACHE_TYPES:
        raise ValueError(
            f"mm_processor_cache_type must be one of {', '.join(PROCESSOR_CACHE_TYPES)}, "
            f"got {cache_type!r}"
        )
    if cache_gb < 0:
        raise ValueError(f"mm_processor_cache_gb must be >= 0, got {cache_gb}")
    if cache_gb == 0:
        return "none"  # vLLM: a size of 0 disables the cache whatever the type
    mode: ProcessorCacheType = cache_type
    return mode


# ---------------------------------------------------------------------- P1 (engine core)
class ReceiverCache:
    """P1's side for modes that send every tensor (`none`, `processor_only`)."""

    def fill(self, features: Sequence[MultiModalFeatureSpec]) -> list[MultiModalFeatureSpec]:
        """Features with their tensors; `ProcessorCacheError` if one cannot be restored."""
        for i, feature in enumerate(features):
            if feature.data is None:
                raise ProcessorCacheError(
                    f"mm_features[{i}] ({feature.identifier}) arrived without data and this "
                    "engine keeps no processor cache"
                )
        return list(features)


class MirrorReceiverCache(ReceiverCache):
    """P1's mirror of an `LRUSenderCache`: same capacity, same operations, same order."""

    def __init__(self, capacity_bytes: int) -> None:
        self.lru: ByteLRU[ItemData] = ByteLRU(capacity_bytes)

    def fill(self, features: Sequence[MultiModalFeatureSpec]) -> list[MultiModalFeatureSpec]:
        out: list[MultiModalFeatureSpec] = []
        missing: list[int] = []
        for i, feature in enumerate(features):
            if feature.data is None:
                data = self.lru.touch(feature.identifier)
                if data is None:
                    missing.append(i)
                    out.append(feature)
                    continue
                feature = msgspec.structs.replace(feature, data=data)
            elif feature.identifier in self.lru:
                self.lru.touch(feature.identifier)  # P0 thought it new; keep the order alike
            else:
                self.lru.put(feature.identifier, feature.data, item_nbytes(feature.data))
            out.append(feature)
        if missing:
            raise ProcessorCacheError(
                f"mm_features{missing} arrived without data and are not in the engine's "
                "processor cache mirror (frontend and engine caches out of step)"
            )
        return out


class ShmReceiverCache(ReceiverCache):
    """P1's reader of `ShmSenderCache` segments (named by prefix + hash)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def fill(self, features: Sequence[MultiModalFeatureSpec]) -> list[MultiModalFeatureSpec]:
        out: list[MultiModalFeatureSpec] = []
        for i, feature in enumerate(features):
            if feature.data is None:
                feature = msgspec.structs.replace(feature, data=self._read(i, feature))
            out.append(feature)
        return out

    def _read(self, index: int, feature: MultiModalFeatureSpec) -> ItemData:
        name = shm_segment_name(self.prefix, feature.identifier)
        try:
            payload = _read_segment(name)
        except FileNotFoundError:
            raise ProcessorCacheError(
                f"mm_features[{index}] ({feature.identifier}) was evicted from shared memory "
                "before the engine read it; raise --mm-processor-cache-gb"
            ) from None
        return _SHM_DECODER.decode(payload)


_DEV_SHM = Path("/dev/shm")


def _read_segment(name: str) -> bytes:
    """The payload of segment `name`, leaving its owner's resource tracking untouched.

    Attaching with `SharedMemory(name)` registers the segment with this
    process's resource tracker (Python < 3.13), which would unlink P0's segment
    when P1 exits, or, when P1 shares P0's tracker (spawned by it), unregistering
    would drop P0's own registration. On Linux a POSIX segment is a file under
    /dev/shm: reading it as one involves no tracker at all.
    """
    if _DEV_SHM.is_dir():
        with open(_DEV_SHM / name, "rb") as f:
            header = f.read(_LEN.size)
            (length,) = _LEN.unpack(header)
            return f.read(length)
    segment = shared_memory.SharedMemory(name=name)
    try:
        if name not in _CREATED_HERE:
            resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
        buf = _buffer(segment)
        (length,) = _LEN.unpack_from(buf, 0)
        return bytes(buf[_LEN.size : _LEN.size + length])
    finally:
        segment.close()


def make_receiver_cache(
    cache_type: str, cache_gb: float, *, shm_prefix: str | None = None
) -> ReceiverCache:
    """P1's counterpart of `make_sender_cache` with the same arguments."""
    mode = _check_mode(cache_type, cache_gb)
    if mode == "lru":
        return MirrorReceiverCache(int(cache_gb * GIB))
    if mode == "shm":
        if shm_prefix is None:
            raise ValueError("the shm processor cache needs the frontend's shm_prefix")
        return ShmReceiverCache(shm_prefix)
    return ReceiverCache()


@dataclass(frozen=True, slots=True)
class ProcessorCacheConfig:
    """What P0 and P1 must agree on (picklable: it travels to the engine process).

    `shm_prefix` names this server's shared-memory segments (`shm` mode only;
    a fresh random one when not given).
    """

    cache_type: str = "lru"
    cache_gb: float = 4.0
    shm_prefix: str | None = None

    def __post_init__(self) -> None:
        if _check_mode(self.cache_type, self.cache_gb) == "shm" and self.shm_prefix is None:
            # Both sides get the config from one object (pickled to the engine).
            object.__setattr__(self, "shm_prefix", new_shm_prefix())

    @property
    def mode(self) -> ProcessorCacheType:
        return _check_mode(self.cache_type, self.cache_gb)

    def make_sender(self) -> SenderCache:
        return make_sender_cache(self.cache_type, self.cache_gb, shm_prefix=self.shm_prefix)

    def make_receiver(self) -> ReceiverCache:
        return make_receiver_cache(self.cache_type, self.cache_gb, shm_prefix=self.shm_prefix)
