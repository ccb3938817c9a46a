"""The Redis tier: chunks shared by every engine of one model through one Redis server.

Keys (one per chunk and rank):

    {namespace}:kv:{space}:{chunk key}:{rank}
      space = sha256(model name, block size, chunk size, TP size)[:16] hex
      chunk key = the hex of the chunk's last chained block hash (chunks.py)

Values are `encode_chunk` bytes: the full layout fingerprint (model, layers,
layer names, KV heads, head size, dtype, TP rank/size) and a blake2b of the
payload, both checked on every read. The scheduler side cannot see the KV
tensors, so the key carries what both sides know and the value the rest: two
models whose keys collide still never serve each other's KV (a foreign or
corrupt value is a load error and the request recomputes).

Who does what:

    scheduler  RemoteLookup.present          one pipelined EXISTS per lookup, deadline
               RemoteLookup.should_write     a bounded set of keys known to be stored
    worker     RedisStore.get                GET with a deadline, then decode + verify
               RedisWriter.offer             bounded queue -> one background thread: SET
                                             (full queue, down, slow, OOM: dropped, counted)

Nothing here ever raises into a step: faults become counters
(`redis.{role}_{reason}`, counted by the `CountedRedis` every call goes
through) and misses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import torch

from paged.connectors.kv.offloading.chunks import (
    FORMAT_VERSION,
    ChunkError,
    ChunkKey,
    Fingerprint,
    decode_chunk,
    encode_chunk,
)
from paged.connectors.kv.offloading.redis_client import GuardedRedis, RedisFault, RedisTierConfig

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Keys the scheduler side remembers as stored (found or written), so a chunk is
# not written again by every request that shares it; a write may have been
# dropped or Redis restarted since, so the memory fades after _KNOWN_TTL_S.
_KNOWN_KEYS = 65_536
_KNOWN_TTL_S = 30.0


@dataclass(frozen=True)
class RedisKeyspace:
    """Where one engine's chunks live in Redis (see the module docstring)."""

    prefix: str
    world_size: int

    @classmethod
    def of(
        cls, config: RedisTierConfig, model: str, block_size: int, chunk_size: int, world_size: int
    ) -> RedisKeyspace:
        ident = json.dumps(
            [FORMAT_VERSION, model, block_size, chunk_size, world_size], separators=(",", ":")
        )
        space = hashlib.sha256(ident.encode()).hexdigest()[:16]
        return cls(f"{config.namespace}:kv:{space}", world_size)

    def key(self, chunk: ChunkKey, rank: int) -> str:
        return f"{self.prefix}:{chunk}:{rank}"


class FaultCounters:
    """Thread-safe counts of `{op}_{reason}` (e.g. read_timeout, write_oom), taken as deltas."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + value

    def take(self) -> dict[str, float]:
        """`{"redis.<name>": delta}` since the last call."""
        with self._lock:
            counts, self._counts = self._counts, {}
        return {f"redis.{name}": value for name, value in counts.items() if value}


class CountedRedis:
    """One role's guarded connection whose faults are counted as `{role}_{reason}`.

    Every Redis operation of the tier goes through one: `GuardedRedis` puts
    the deadline on it, backs off and drops the pool's sockets after a fault
    (the next call reconnects); this names the fault in the role's counters
    (`lookup_down`, `read_timeout`, `write_oom`, ...) before re-raising it.
    """

    def __init__(
        self, config: RedisTierConfig, role: str, timeout_s: float, counters: FaultCounters
    ) -> None:
        self.role = role
        self.counters = counters
        self._redis = GuardedRedis(config, timeout_s)

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        """`fn(client)`; a `RedisFault` is counted, then raised."""
        try:
            return self._redis.call(fn)
        except RedisFault as fault:
            self.count(fault.reason)
            raise

    def count(self, what: str) -> None:
        """Count an outcome of this role that is not a fault of the call (`read_miss`, ...)."""
        self.counters.add(f"{self.role}_{what}")

    def close(self) -> None:
        self._redis.close()


@dataclass(frozen=True)
class RedisRank:
    """One worker rank's chunks in Redis: where their keys are, what their values must carry."""

    keyspace: RedisKeyspace
    fingerprint: Fingerprint  # `redis_fingerprint`: the layout and the model's name

    def key(self, chunk: ChunkKey) -> str:
        return self.keyspace.key(chunk, self.fingerprint.rank)


class RemoteLookup:
    """Scheduler side: which leading chunks of a request every rank has in Redis."""

    def __init__(
        self,
        config: RedisTierConfig,
        keyspace: RedisKeyspace,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keyspace = keyspace
        self.counters = FaultCounters()
        self.redis = CountedRedis(config, "lookup", config.read_timeout_s, self.counters)
        self._clock = clock
        # key -> when it was last known stored; oldest first.
        self._known: OrderedDict[ChunkKey, float] = OrderedDict()

    def present(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each of `keys` is stored for every rank, in one pipelined round trip
        (all False on any fault: the request recomputes)."""
        if not keys:
            return []
        names = [self.keyspace.key(k, r) for k in keys for r in range(self.keyspace.world_size)]

        def exists(client: redis.Redis) -> list[object]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            result: list[object] = pipe.execute()
            return result

        try:
            found = self.redis.call(exists)
        except RedisFault:  # counted
            return [False] * len(keys)
        if len(found) != len(names) or any(type(f) is not int for f in found):
            self.redis.count("garbage")
            return [False] * len(keys)
        ws = self.keyspace.world_size
        present = [all(found[i * ws : (i + 1) * ws]) for i in range(len(keys))]
        for key, stored in zip(keys, present, strict=True):
            if stored:
                self._remember(key)  # stored by someone: no need to write it again
        return present

    def should_write(self, key: ChunkKey) -> bool:
        """True unless `key` was found or written in the last _KNOWN_TTL_S seconds."""
        seen = self._known.get(key)
        if seen is not None and self._clock() - seen < _KNOWN_TTL_S:
            return False
        self._remember(key)
        return True

    def forget(self, key: ChunkKey) -> None:
        """A load of `key` failed: the recomputed chunk is written again."""
        self._known.pop(key, None)

    def _remember(self, key: ChunkKey) -> None:
        self._known[key] = self._clock()
        self._known.move_to_end(key)
        while len(self._known) > _KNOWN_KEYS:
            self._known.popitem(last=False)

    def close(self) -> None:
        self.redis.close()


class RedisStore:
    """Worker side, reads: GET with the read deadline, then the value's checks."""

    def __init__(self, config: RedisTierConfig, rank: RedisRank, counters: FaultCounters) -> None:
        self.rank = rank
        self.redis = CountedRedis(config, "read", config.read_timeout_s, counters)

    def get(self, key: ChunkKey, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The chunk's tensor; `ChunkError` (counted by reason) for anything but a good value."""
        name = self.rank.key(key)
        try:
            data = self.redis.call(lambda c: c.get(name))
        except RedisFault as fault:  # counted
            raise ChunkError(str(fault)) from fault
        if data is None:  # evicted or expired since the lookup, or flushed
            self.redis.count("miss")
            raise ChunkError(f"chunk {key[:16]} is no longer in Redis")
        if not isinstance(data, bytes):
            self.redis.count("garbage")
            raise ChunkError(f"redis answered {type(data).__name__} for chunk {key[:16]}")
        try:
            payload = decode_chunk(memoryview(bytearray(data)), self.rank.fingerprint)
        except ChunkError:
            self.redis.count("corrupt")
            raise
        expected = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        if len(payload) != expected:
            self.redis.count("corrupt")
            raise ChunkError(f"redis chunk {key[:16]}: {len(payload)} bytes, want {expected}")
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(shape)

    def close(self) -> None:
        self.redis.close()


@dataclass
class _Write:
    key: ChunkKey
    chunk: torch.Tensor


class RedisWriter:
    """Worker side, writes: a bounded queue drained by one thread; a step never waits.

    `offer` drops (and counts) a chunk when the queue is full; the thread
    drops (and counts) one the server refuses: down, past the write deadline,
    out of memory (maxmemory + noeviction), in backoff.
    """

    def __init__(self, config: RedisTierConfig, rank: RedisRank, counters: FaultCounters) -> None:
        self.config = config
        self.rank = rank
        self.counters = counters
        self.redis = CountedRedis(config, "write", config.write_timeout_s, counters)
        self._queue: queue.Queue[_Write | None] = queue.Queue(config.max_pending_writes)
        self._thread = threading.Thread(target=self._run, name="paged-kv-redis", daemon=True)
        self._thread.start()

    def offer(self, key: ChunkKey, chunk: torch.Tensor) -> bool:
        """Queue a chunk (a host tensor nobody writes to again); False if dropped."""
        try:
            self._queue.put_nowait(_Write(key, chunk))
        except queue.Full:
            self.redis.count("queue_full")
            return False
        return True

    def flush(self) -> None:
        """Block until every queued write ran (tests, shutdown)."""
        self._queue.join()

    def close(self, timeout_s: float = 10.0) -> None:
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            logger.warning("KV redis tier: writer still busy at shutdown, pending writes lost")
            return
        self._thread.join(timeout=timeout_s)
        self.redis.close()

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            try:
                if op is None:
                    return
                self._write(op)
            except Exception:  # a failed write is a later miss, never a dead engine
                logger.exception("KV redis tier: write of chunk %s failed", op)
            finally:
                self._queue.task_done()

    def _write(self, op: _Write) -> None:
        start = time.perf_counter()
        flat = op.chunk.contiguous().view(torch.uint8).reshape(-1)
        data = encode_chunk(self.rank.fingerprint, memoryview(flat.numpy().data))
        name = self.rank.key(op.key)
        ttl = self.config.ttl_s or None
        try:
            self.redis.call(lambda c: c.set(name, data, ex=ttl))
        except RedisFault:  # counted
            return
        self.counters.add("bytes_saved", len(data))
        self.counters.add("seconds_saved", time.perf_counter() - start)


def redis_fingerprint(fingerprint: Fingerprint, model: str) -> Fingerprint:
    """The layout fingerprint with the model's name: what a Redis value must match."""
    return replace(fingerprint, model=model)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
