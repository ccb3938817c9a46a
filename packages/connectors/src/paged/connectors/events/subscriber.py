"""A KV event subscriber: follows the PUB stream, fills gaps through replay.

`KVEventSubscriber` connects a SUB socket to the publisher's endpoint and a
DEALER socket to its replay endpoint (a DEALER, not vLLM example's REQ: a
REQ socket takes one reply per request, and a replay is many). It hands out
batches in sequence order, each once: when a message arrives with a sequence
number past the next expected one, the missing ones are asked for by replay
first; what replay no longer holds is counted in `num_lost`. It decodes the
layout it is told (`wire_format`: "vllm", vLLM 0.33.0 and paged's default;
"map", paged's earlier default; or "array", vLLM 0.2x); a payload in another
layout raises `KVEventDecodeError`, which says so.

`CachedBlockIndex` rebuilds, from events alone, which block hashes the engine
holds: a count per `(medium, group_idx, hash)`, since two blocks may cache
the same content (vLLM does not de-duplicate) and each leaves with its own
`BlockRemoved`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import msgspec
import zmq

from paged.connectors.events.codec import make_codec
from paged.connectors.events.config import WireFormat
from paged.connectors.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    decode_seq,
    encode_seq,
)

BlockKey = tuple[str | None, int | None, ExternalBlockHash]  # (medium, group_idx, hash)


# The media a device prefix-cache reset (AllBlocksCleared) empties.
DEVICE_MEDIA = frozenset({"GPU", None})


class KVEventDecodeError(ValueError):
    """A payload is not a `KVEventBatch` in the layout the subscriber was given."""


class CachedBlockIndex:
    """The multiset of cached blocks implied by a stream of events.

    `AllBlocksCleared` carries no medium; it is what a reset of the device
    prefix cache publishes, so it clears the device's blocks ("GPU", or no
    medium as older vLLM sends) and keeps the offload tiers' ("CPU", "STORAGE"),
    which announce their own removals. A removal of a block the index does
    not hold (its store was lost) is counted, not raised.
    """

    def __init__(self) -> None:
        self.blocks: Counter[BlockKey] = Counter()
        self.num_unknown_removals = 0

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self.blocks[(event.medium, event.group_idx, h)] += 1
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    key = (event.medium, event.group_idx, h)
                    if self.blocks[key] > 0:
                        self.blocks[key] -= 1
                    else:
                        self.num_unknown_removals += 1
                    if self.blocks[key] == 0:
                        del self.blocks[key]
            elif isinstance(event, AllBlocksCleared):
                for key in [k for k in self.blocks if k[0] in DEVICE_MEDIA]:
                    del self.blocks[key]

    def hashes(self, medium: str | None = "GPU") -> Counter[tuple[int | None, ExternalBlockHash]]:
        """Cached blocks of one medium: count per (group_idx, hash)."""
        return Counter({(g, h): n for (m, g, h), n in self.blocks.items() if m == medium})


class KVEventSubscriber:
    """Receives `KVEventBatch`es in sequence order from a paged or vLLM publisher.

    Every wait is bounded by the `timeout_ms` given; a publisher that is gone
    only makes `poll` return nothing. `wire_format` must be the publisher's
    (its `--kv-events-config` `wire_format`; a vLLM publisher: "vllm" for
    vLLM 0.33.0, "array" for 0.2x and before). Close with `close()` (or use
    `with`).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        wire_format: WireFormat = "vllm",
    ) -> None:
        self._codec = make_codec(wire_format)  # first: a bad value opens no socket
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self.next_seq = 0  # the next sequence number to hand out
        self.num_lost = 0

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def poll(self, timeout_ms: int = 100) -> list[tuple[int, KVEventBatch]]:
        """Batches that arrived within `timeout_ms` (waiting only for the first), in order."""
        out: list[tuple[int, KVEventBatch]] = []
        wait = timeout_ms
        while self._sub.poll(wait):
            wait = 0
            _topic, seq_frame, payload = self._sub.recv_multipart()
            seq = decode_seq(seq_frame)
            if seq < self.next_seq:
                continue  # already had it through replay
            if seq > self.next_seq:
                out.extend(self.replay(self.next_seq, until=seq, timeout_ms=max(timeout_ms, 100)))
                self.num_lost += seq - self.next_seq  # what replay could not give
            out.append((seq, self._decode(seq, payload)))
            self.next_seq = seq + 1
        return out

    def catch_up(self, timeout_ms: int = 1000) -> list[tuple[int, KVEventBatch]]:
        """Everything the replay ring holds from `next_seq` on (a late joiner's first call)."""
        got = list(self.replay(self.next_seq, until=None, timeout_ms=timeout_ms))
        return got + self.poll(0)

    def replay(
        self, start: int, until: int | None, timeout_ms: int
    ) -> Iterator[tuple[int, KVEventBatch]]:
        """Ask for batches `start..` and yield those below `until`, advancing `next_seq`."""
        if self._replay is None:
            return
        try:
            self._replay.send_multipart((b"", encode_seq(start)), flags=zmq.NOBLOCK)
        except zmq.Again:
            return  # the replay pipe is full: the publisher is not reading
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._replay.poll(left_ms):
                # The publisher went away mid-replay. A fresh DEALER would be
                # cleaner, but the next request is tagged by `start`, so stray
                # late replies are skipped as duplicates.
                return
            # (b"", topic, seq, payload); the end marker (b"", b"", -1, b"").
            frames = self._replay.recv_multipart()
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                continue
            seq = decode_seq(frames[2])
            if seq < 0:
                return  # end-of-replay marker
            if seq < self.next_seq or (until is not None and seq >= until):
                continue
            batch = self._decode(seq, frames[3])  # first: one that fails is not handed out
            self.num_lost += seq - self.next_seq
            self.next_seq = seq + 1
            yield seq, batch

    def _decode(self, seq: int, payload: bytes) -> KVEventBatch:
        try:
            return self._codec.decode(payload)
        except msgspec.DecodeError as e:  # ValidationError is a DecodeError
            raise KVEventDecodeError(
                f"KV event batch {seq} is not a batch in the {self._codec.wire_format!r} "
                f"wire layout (does the publisher use another wire_format?): {e}"
            ) from e
