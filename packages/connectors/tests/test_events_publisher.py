"""`ZmqEventPublisher`: frames, monotonic sequence numbers, replay, and never blocking.

Endpoints are ipc:// files in the test's tmp dir (bound, nothing on the network).
"""

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from paged.connectors.events import (
    KVEventsConfig,
    NullEventPublisher,
    ZmqEventPublisher,
    make_event_publisher,
)
from paged.connectors.events.wire import END_OF_REPLAY, KVEventBatch, decode_seq, encode_seq
from paged.kvcache.events import BlockRemoved, KVCacheEvent

pytestmark = pytest.mark.timeout(60)


def _config(tmp_path: Path, **kw: object) -> KVEventsConfig:
    fields: dict[str, object] = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp_path}/pub",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
        "topic": "kv",
    }
    fields.update(kw)
    return KVEventsConfig(**fields)  # type: ignore[arg-type]


def _removed(i: int) -> list[KVCacheEvent]:
    return [BlockRemoved(block_hashes=[i.to_bytes(32, "big")])]  # type: ignore[list-item]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.term()


def _sub(ctx: zmq.Context[zmq.Socket[bytes]], cfg: KVEventsConfig) -> zmq.Socket[bytes]:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
    s.connect(cfg.endpoint)
    return s


def _recv_all(sock: zmq.Socket[bytes], n: int, timeout_s: float = 10) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        if sock.poll(100):
            got.append(sock.recv_multipart())
    return got


def _connected(pub: ZmqEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish until `sub` receives one message; returns how many were published."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish(_removed(pub.next_seq))
        if sub.poll(50):
            sub.recv_multipart()
            while sub.poll(50):
                sub.recv_multipart()
            return pub.next_seq
    raise AssertionError("subscriber never connected")


def _replay(
    ctx: zmq.Context[zmq.Socket[bytes]], cfg: KVEventsConfig, start: int
) -> list[tuple[int, bytes]]:
    assert cfg.replay_endpoint is not None
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(cfg.replay_endpoint)
    try:
        req.send_multipart((b"", encode_seq(start)))
        out: list[tuple[int, bytes]] = []
        while req.poll(5000):
            # vLLM 0.33.0's reply: (b"", topic, seq, payload); the marker (b"", b"", -1, b"").
            empty, topic, seq, payload = req.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert (topic, payload) == (b"", b"")
                return out
            assert topic == cfg.topic.encode()
            out.append((decode_seq(seq), payload))
        raise AssertionError("no end-of-replay marker")
    finally:
        req.close()


def test_frames_are_topic_seq_payload_with_monotonic_seqs(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    cfg = _config(tmp_path)
    pub = ZmqEventPublisher(cfg, data_parallel_rank=2, context=ctx)
    sub = _sub(ctx, cfg)
    try:
        first = _connected(pub, sub)
        for _ in range(20):
            pub.publish(_removed(pub.next_seq))
        frames = _recv_all(sub, 20)
        assert len(frames) == 20
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        seqs = []
        for topic, seq_frame, payload in frames:
            assert topic == b"kv" and len(seq_frame) == 8
            seq = int.from_bytes(seq_frame, "big")
            batch = decoder.decode(payload)
            assert batch.data_parallel_rank == 2
            # The payload is the batch published with that sequence number.
            assert batch.events[0].block_hashes == [seq]  # type: ignore[union-attr]
            seqs.append(seq)
        assert seqs == list(range(first, first + 20))
    finally:
        sub.close()
        pub.shutdown()


def test_replay_from_n_then_end_marker(tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    cfg = _config(tmp_path, buffer_steps=5)
    pub = ZmqEventPublisher(cfg, context=ctx)
    try:
        for i in range(8):
            pub.publish(_removed(i))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(_replay(ctx, cfg, 0)) < 5:
            time.sleep(0.05)
        # The ring holds the last buffer_steps batches: 3..7.
        assert [s for s, _ in _replay(ctx, cfg, 0)] == [3, 4, 5, 6, 7]
        got = _replay(ctx, cfg, 6)
        assert [s for s, _ in got] == [6, 7]
        batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(got[0][1])
        assert batch.events[0].block_hashes == [6]  # type: ignore[union-attr]
        assert _replay(ctx, cfg, 100) == []
    finally:
        pub.shutdown()


@pytest.mark.parametrize("wire_format", ["vllm", "map", "array"])
def test_wire_format_picks_the_layout_live_and_in_replay(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]], wire_format: str
) -> None:
    cfg = _config(tmp_path, wire_format=wire_format)
    pub = ZmqEventPublisher(cfg, context=ctx)
    sub = _sub(ctx, cfg)
    try:
        first = _connected(pub, sub)
        pub.publish(_removed(first))
        ((_, _, live),) = _recv_all(sub, 1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(_replay(ctx, cfg, first)) < 1:
            time.sleep(0.05)
        ((seq, replayed),) = _replay(ctx, cfg, first)
        assert seq == first and replayed == live  # replay resends the same bytes
        raw = msgspec.msgpack.decode(live)
        if wire_format == "vllm":
            assert raw == [
                raw[0],
                [{"type": "BlockRemoved", "block_hashes": [first], "medium": "GPU"}],
                0,
            ]
        elif wire_format == "map":
            assert raw == {
                "ts": raw["ts"],
                "events": [{"type": "BlockRemoved", "block_hashes": [first], "medium": "GPU"}],
                "data_parallel_rank": 0,
            }
        else:
            assert raw == [raw[0], [["BlockRemoved", [first], "GPU", None]], 0]
    finally:
        sub.close()
        pub.shutdown()


def test_vanished_and_malformed_replay_clients_do_not_stop_the_publisher(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    cfg = _config(tmp_path)
    pub = ZmqEventPublisher(cfg, context=ctx)
    assert cfg.replay_endpoint is not None
    try:
        pub.publish(_removed(0))
        gone = ctx.socket(zmq.DEALER)
        gone.connect(cfg.replay_endpoint)
        gone.send_multipart((b"", encode_seq(0)))
        gone.close(linger=100)  # asks, then vanishes before the answer
        bad = ctx.socket(zmq.DEALER)
        bad.connect(cfg.replay_endpoint)
        bad.send_multipart((b"", b"short"))
        bad.close(linger=100)
        pub.publish(_removed(1))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(_replay(ctx, cfg, 0)) < 2:
            time.sleep(0.05)
        assert [s for s, _ in _replay(ctx, cfg, 0)] == [0, 1]
    finally:
        pub.shutdown()


def test_a_subscriber_that_never_reads_does_not_block_publishing(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    cfg = _config(tmp_path, hwm=10, replay_endpoint=None)
    pub = ZmqEventPublisher(cfg, context=ctx)
    stalled = _sub(ctx, cfg)
    stalled.setsockopt(zmq.RCVHWM, 10)
    try:
        _connected(pub, stalled)
        start = time.monotonic()
        for i in range(5000):
            pub.publish(_removed(i))
        pub.shutdown()  # flushes: every batch went out (ZMQ dropped for the stalled one)
        assert time.monotonic() - start < 20
        assert pub.num_dropped == 0
        # ZMQ dropped most for the stalled subscriber: it holds about the two high-water
        # marks' worth plus what the kernel's socket buffers took (seen: 20 to 219), far
        # from all 5,000.
        assert len(_recv_all(stalled, 5000, timeout_s=1)) < 1000
    finally:
        stalled.close()
        pub.shutdown()


def test_full_queue_drops_instead_of_blocking_and_leaves_a_gap(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path, max_queue_size=2, replay_endpoint=None)
    pub = ZmqEventPublisher(cfg, context=ctx)
    release = threading.Event()
    real_send = pub._send

    def stuck_send(*args: object) -> None:
        release.wait(10)  # the publisher thread is stuck (e.g. a huge batch)
        real_send(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pub, "_send", stuck_send)
    sub = _sub(ctx, cfg)
    try:
        start = time.monotonic()
        for i in range(10):
            pub.publish(_removed(i))
        assert time.monotonic() - start < 1.0  # publish() never waited
        # One batch is held by the stuck thread, two wait in the queue, the rest dropped.
        assert 7 <= pub.num_dropped <= 8
        assert pub.next_seq == 10
    finally:
        release.set()
        sub.close()
        pub.shutdown()


def test_publish_after_shutdown_is_an_error(tmp_path: Path) -> None:
    pub = ZmqEventPublisher(_config(tmp_path))
    pub.shutdown()
    pub.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        pub.publish(_removed(0))


def test_busy_endpoint_fails_at_construction(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = _config(tmp_path, replay_endpoint=f"tcp://127.0.0.1:{port}")
        with pytest.raises(OSError, match="cannot open its socket"):
            ZmqEventPublisher(cfg)


def test_factory_picks_the_publisher(tmp_path: Path) -> None:
    assert isinstance(make_event_publisher(None), NullEventPublisher)
    assert isinstance(make_event_publisher(KVEventsConfig()), NullEventPublisher)
    null = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert isinstance(make_event_publisher(null), NullEventPublisher)
    pub = make_event_publisher(_config(tmp_path))
    try:
        assert isinstance(pub, ZmqEventPublisher)
    finally:
        pub.shutdown()
