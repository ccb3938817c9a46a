"""Publishers of KV event batches: `NullEventPublisher` and `ZmqEventPublisher`.

The engine core calls `publish(events)` once per step that produced events;
the call never blocks and never touches a socket. `ZmqEventPublisher` hands
the batch to a background thread through a bounded queue; that thread
converts it to vLLM's wire structs, encodes it in the config's `wire_format`
("vllm": vLLM 0.33.0, the default; "map", "array": older layouts, see
`codec.py`), sends it on the
PUB socket and keeps it in a ring of the last `buffer_steps` batches for
replay (replay sends the same bytes, so the same layout).

Nothing a subscriber does can stall the engine:
- PUB never blocks: a subscriber that is slow or gone gets its messages
  dropped by ZMQ once `hwm` are queued for it;
- the ROUTER replay socket drops replies to a peer that has vanished (no
  ROUTER_MANDATORY) or whose pipe is full;
- when the publisher thread itself falls `max_queue_size` batches behind,
  `publish` drops the batch (counted in `num_dropped`, logged) instead of
  waiting. Sequence numbers are given out in `publish`, so a dropped batch
  leaves a gap that subscribers see.

Replay (vLLM 0.33.0's protocol, vllm/distributed/kv_events.py:521-539): a
DEALER sends `(b"", N)`, N the first sequence number it wants, 8 bytes
big-endian (the ROUTER sees `(identity, b"", N)`). The ROUTER answers with
one message per buffered batch with `seq >= N`, oldest first, which the
DEALER reads as `(b"", topic, seq, payload)` (the PUB message's three frames
behind the empty delimiter), then the end-of-replay marker
`(b"", b"", -1 as 8 signed big-endian bytes, b"")`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq

from paged.connectors.events.codec import BatchCodec, make_codec
from paged.connectors.events.config import KVEventsConfig
from paged.connectors.events.wire import END_OF_REPLAY, decode_seq, encode_seq, make_batch
from paged.kvcache.events import KVCacheEvent

logger = logging.getLogger(__name__)


class EventPublisher(Protocol):
    """What the engine core holds to publish KV events.

    `publish` is called on the engine thread once per step with the step's
    events (never empty); it must return at once. `shutdown` is called once;
    it flushes what it can within a bounded time and closes every socket.
    """

    def publish(self, events: Sequence[KVCacheEvent]) -> None: ...

    def shutdown(self) -> None: ...


class NullEventPublisher:
    """Drops every batch (publisher "null", or events disabled)."""

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        return

    def shutdown(self) -> None:
        return


@dataclass(frozen=True, slots=True)
class _Pending:
    seq: int
    ts: float
    events: tuple[KVCacheEvent, ...]


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard, ipc or inproc address, else connect."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class ZmqEventPublisher:
    """PUB socket + ROUTER replay socket, served by one background thread.

    Sockets are created here (so a bad or busy endpoint fails at start-up, on
    the caller's thread) and used only by the thread afterwards (ZMQ sockets
    are not thread-safe); so is the codec. `data_parallel_rank` goes into
    every batch.
    """

    SHUTDOWN_TIMEOUT_S = 1.0
    _POLL_MS = 50

    def __init__(
        self,
        config: KVEventsConfig,
        data_parallel_rank: int = 0,
        use_int_hashes: bool = True,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self._codec: BatchCodec = make_codec(config.wire_format)
        self._topic = config.topic.encode()
        self._dp_rank = data_parallel_rank
        self._use_int_hashes = use_int_hashes
        self._queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0
        self._ctx = context if context is not None else zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # vLLM's (kv_events.py:368-370, 457): room for a full replay
                # plus its marker even though ZMQ credits reads every HWM/2.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"KV events publisher cannot open its socket: {e}") from e
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info(
            "KV events: publishing (%s layout) on %s%s",
            config.wire_format,
            config.endpoint,
            f", replay on {config.replay_endpoint}" if config.replay_endpoint else "",
        )

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets (= batches published so far)."""
        return self._next_seq

    # ---- engine thread ---------------------------------------------------------
    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        if self._stop.is_set():
            raise RuntimeError("the KV events publisher is shut down")
        pending = _Pending(self._next_seq, time.time(), tuple(events))
        self._next_seq += 1
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning(
                    "KV events: publisher queue full, %d batch(es) dropped so far",
                    self.num_dropped,
                )

    def shutdown(self) -> None:
        """Send what is queued (at most SHUTDOWN_TIMEOUT_S), stop the thread, close sockets."""
        if self._stop.is_set():
            return
        self._stop.set()
        # On a full queue the thread still sees _stop after its next batch.
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S + 1.0)
        if self._thread.is_alive():
            logger.warning("KV events: publisher thread did not stop in time")
            return  # it still owns the sockets; they go with the process
        self._close_sockets()

    # ---- publisher thread --------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None:
                # Replay requests are served between batches, never ahead of
                # a batch already queued for more than one poll interval.
                while dict(poller.poll(0)).get(self._replay):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=self._POLL_MS / 1000)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if item is None:
                return
            try:
                self._send(item)
            except Exception:
                # One bad batch must not end publishing for the engine's lifetime.
                logger.exception("KV events: failed to publish batch %d", item.seq)

    def _send(self, item: _Pending) -> None:
        batch = make_batch(item.events, item.ts, self._dp_rank, self._use_int_hashes)
        payload = self._codec.encode(batch)
        seq_frame = encode_seq(item.seq)
        self._pub.send_multipart((self._topic, seq_frame, payload), flags=zmq.NOBLOCK)
        self._buffer.append((item.seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning("KV events: ignoring a malformed replay request")
            return
        identity, _, start_frame = frames
        start = decode_seq(start_frame)
        try:
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart(
                        (identity, b"", self._topic, encode_seq(seq), payload),
                        flags=zmq.NOBLOCK,
                    )
            self._replay.send_multipart((identity, b"", b"", END_OF_REPLAY, b""), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("KV events: replay client is not reading; reply cut short")

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def make_event_publisher(
    config: KVEventsConfig | None, data_parallel_rank: int = 0
) -> EventPublisher:
    """The publisher `config` asks for; `NullEventPublisher` when events are off."""
    if config is None or not config.publishes:
        return NullEventPublisher()
    if config.publisher == "zmq":
        return ZmqEventPublisher(config, data_parallel_rank)
    raise ValueError(f"unknown KV events publisher {config.publisher!r}")
