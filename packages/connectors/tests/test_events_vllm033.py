"""paged's default KV event stream, read by a decoder declared from vLLM 0.33.0's classes.

vllm cannot be installed here, so the structs below are written from
vllm-0.33.0/vllm/distributed/kv_events.py itself, not imported from paged:
names (the tag is the class name), field order, types, defaults and struct
options. A change to paged's layout that vLLM 0.33.0 would not decode fails
here. The replay tests talk to the publisher through a real zmq DEALER, as
vLLM's subscribers do.
"""

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from paged.connectors.events import KVEventsConfig, ZmqEventPublisher, make_batch, make_codec
from paged.connectors.events.wire import external_block_hash
from paged.kvcache import events as kv

pytestmark = pytest.mark.timeout(60)

# ---- vLLM 0.33.0's definitions ---------------------------------------------------
# vllm/v1/core/kv_cache_utils.py:57
ExternalBlockHash = bytes | int


# vllm/distributed/kv_events.py:31-39: the batch is array_like.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# kv_events.py:42-48: events are maps (no array_like), tagged by class name.
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


# kv_events.py:56-98
class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


# kv_events.py:123-130
class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


# kv_events.py:144-145
class AllBlocksCleared(KVCacheEvent):
    pass


# kv_events.py:148-149
class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# kv_events.py:339: the end-of-replay sequence frame.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

VLLM_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)

# ---- paged's events ------------------------------------------------------------------
H0, H1, H2 = (bytes([i]) * 32 for i in (1, 2, 3))


def _events() -> list[kv.KVCacheEvent]:
    return [
        kv.BlockStored(
            block_hashes=[H1, H2],  # type: ignore[list-item]
            parent_block_hash=H0,  # type: ignore[arg-type]
            token_ids=list(range(8)),
            block_size=4,
            lora_name="adapter",
            extra_keys=[("adapter",), ("adapter", ("img", 2))],
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
        ),
        kv.BlockStored(
            block_hashes=[H0],  # type: ignore[list-item]
            parent_block_hash=None,
            token_ids=[7] * 4,
            block_size=4,
            medium=kv.MEDIUM_CPU,
        ),
        kv.BlockRemoved(block_hashes=[H0], group_idx=1),  # type: ignore[list-item]
        kv.AllBlocksCleared(),
    ]


def test_vllm_033_decodes_every_field_of_the_default_payload() -> None:
    payload = make_codec().encode(make_batch(_events(), ts=2.0, data_parallel_rank=3))
    batch = VLLM_DECODER.decode(payload)
    i = external_block_hash
    assert (batch.ts, batch.data_parallel_rank) == (2.0, 3)
    assert batch.events == [
        BlockStored(
            block_hashes=[i(H1), i(H2)],
            parent_block_hash=i(H0),
            token_ids=list(range(8)),
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name="adapter",
            # msgpack has one array type: inner tuples come back as lists.
            extra_keys=[("adapter",), ("adapter", ["img", 2])],
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
        ),
        BlockStored([i(H0)], None, [7] * 4, 4, None, "CPU", None),
        BlockRemoved(block_hashes=[i(H0)], medium="GPU", group_idx=1),
        AllBlocksCleared(),
    ]


def test_default_payload_is_an_array_batch_of_tagged_maps() -> None:
    """The layout pinned: vLLM 0.33.0's decoder refuses anything else."""
    payload = make_codec().encode(make_batch(_events()[2:], ts=1.5))
    assert msgspec.msgpack.decode(payload) == [
        1.5,
        [
            {"type": "BlockRemoved", "block_hashes": [external_block_hash(H0)], "medium": "GPU",
             "group_idx": 1},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]  # fmt: skip


@pytest.mark.parametrize("use_int_hashes", [True, False])
def test_default_payload_is_the_bytes_vllm_033_writes(use_int_hashes: bool) -> None:
    """Re-encoding with vLLM's structs gives the same bytes: keys, order, omissions."""
    payload = make_codec().encode(make_batch(_events(), ts=2.5, use_int_hashes=use_int_hashes))
    assert msgspec.msgpack.encode(VLLM_DECODER.decode(payload)) == payload


def test_paged_reads_every_field_vllm_033_sends() -> None:
    sent = KVEventBatch(
        ts=1.0,
        events=[
            BlockStored(
                block_hashes=[5, b"\x01" * 32],
                parent_block_hash=4,
                token_ids=[1, 2],
                block_size=2,
                lora_id=3,
                medium="STORAGE",
                lora_name="a",
                extra_keys=[None, ("a",)],
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128,
                locality="REMOTE",
                ownership="tier-1",
                session_id="s",
                lookahead_token_ids=[[3], [4]],
            ),
            BlockRemoved([5], "STORAGE", 1, "REMOTE", "tier-1"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )
    got = make_codec("vllm").decode(msgspec.msgpack.encode(sent))
    # Field for field the same values (paged's structs are other classes).
    assert [msgspec.structs.asdict(e) for e in got.events] == [
        msgspec.structs.asdict(e) for e in sent.events
    ]
    assert [type(e).__name__ for e in got.events] == [type(e).__name__ for e in sent.events]
    assert (got.ts, got.data_parallel_rank) == (1.0, 2)


@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_older_layouts_stay_selectable_and_vllm_033_refuses_them(wire_format: Any) -> None:
    payload = make_codec(wire_format).encode(make_batch(_events(), ts=0.0))
    assert make_codec(wire_format).decode(payload).events[2] == make_batch(_events(), 0.0).events[2]
    error = "Expected `array`, got `object`" if wire_format == "map" else "Expected `object`"
    with pytest.raises(msgspec.ValidationError, match=error):
        VLLM_DECODER.decode(payload)


# ---- the sockets -------------------------------------------------------------------
@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.term()


def _replay_frames(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int
) -> list[list[bytes]]:
    """Every message of one replay, as a DEALER receives it, end marker included."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        # vLLM's ROUTER wants (identity, b"", start): the DEALER sends (b"", start).
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[list[bytes]] = []
        while dealer.poll(5000):
            out.append(dealer.recv_multipart())
            if out[-1][2:3] == [END_SEQ]:
                return out
        raise AssertionError(f"no end-of-replay marker after {out}")
    finally:
        dealer.close()


def test_live_and_replayed_messages_are_vllm_033s(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv-events",
    )
    assert cfg.replay_endpoint is not None
    pub = ZmqEventPublisher(cfg, data_parallel_rank=1, context=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(cfg.endpoint)
    try:
        pub.publish(_events()[:2])
        pub.publish(_events()[2:])
        deadline = time.monotonic() + 10
        frames = _replay_frames(ctx, cfg.replay_endpoint, 0)
        while len(frames) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
            frames = _replay_frames(ctx, cfg.replay_endpoint, 0)
        # kv_events.py:532-539: (b"", topic, seq, payload) per batch, then (b"", b"", -1, b"").
        first, second, end = frames
        assert first[:3] == [b"", b"kv-events", (0).to_bytes(8, "big")]
        assert second[:3] == [b"", b"kv-events", (1).to_bytes(8, "big")]
        assert end == [b"", b"", b"\xff" * 8, b""]
        assert len(first) == len(second) == 4
        batches = [VLLM_DECODER.decode(m[3]) for m in (first, second)]
        assert [b.data_parallel_rank for b in batches] == [1, 1]
        assert [type(e) for b in batches for e in b.events] == [
            BlockStored,
            BlockStored,
            BlockRemoved,
            AllBlocksCleared,
        ]
        # From seq 1 on: only the second batch, then the marker.
        assert _replay_frames(ctx, cfg.replay_endpoint, 1) == [second, end]
        # Live: (topic, seq, payload). The SUB may have missed the first messages
        # (slow joiner), so publish until one arrives; it is vLLM's too.
        while not sub.poll(50) and time.monotonic() < deadline:
            pub.publish(_events()[3:])
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv-events" and len(seq) == 8
        replayed = {m[2]: m[3] for m in (first, second)}
        if seq in replayed:  # replay resends the bytes published live
            assert payload == replayed[seq]
        assert VLLM_DECODER.decode(payload).data_parallel_rank == 1
    finally:
        sub.close()
        pub.shutdown()
