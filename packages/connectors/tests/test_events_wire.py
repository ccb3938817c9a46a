"""The older wire layouts ("map", "array"), checked against independent decoders.

The default layout ("vllm") is checked against vLLM 0.33.0's own class
definitions in test_events_vllm033.py. The `Vllm*` structs below decode the
"map" layout, paged's earlier default: vLLM 0.33.0's event structs
(`vllm/distributed/kv_events.py:42-149`) under a batch that is a map, not
imported from paged, so a change of field order, default or options in paged
fails here. The `Array*V` and `Old*` ones are vLLM 0.2x's `array_like=True`
structs and vLLM's old example subscriber, for the legacy "array" layout.
"""

from typing import Any

import msgspec
import pytest

from paged.connectors.events.codec import ArrayCodec, MapCodec, make_codec
from paged.connectors.events.wire import (
    END_OF_REPLAY,
    KVEventBatch,
    decode_seq,
    encode_seq,
    external_block_hash,
    make_batch,
)
from paged.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


# ---- the "map" layout: vLLM 0.33.0's events, the batch a map ------------------------
class VllmEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
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


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


# ---- vLLM 0.2x (arrays) --------------------------------------------------------
class ArrayEventBatchV(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayKVCacheEventV(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStoredV(ArrayKVCacheEventV, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None  # declared by late array-era decoders
    kv_cache_spec_sliding_window: int | None = None


class ArrayBlockRemovedV(ArrayKVCacheEventV, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksClearedV(ArrayKVCacheEventV, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatchV(ArrayEventBatchV):
    events: list[ArrayBlockStoredV | ArrayBlockRemovedV | ArrayAllBlocksClearedV]


# The decoder of vLLM's old examples/online_serving/kv_events_subscriber.py (fewer fields).
class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(OldBatch):
    events: list[OldStored | OldRemoved | OldCleared]


H0, H1, H2 = (bytes([i]) * 32 for i in (1, 2, 3))


def _events() -> list[KVCacheEvent]:
    return [
        BlockStored(
            block_hashes=[H1, H2],  # type: ignore[list-item]
            parent_block_hash=H0,  # type: ignore[arg-type]
            token_ids=list(range(8)),
            block_size=4,
            lora_name="adapter",
            extra_keys=[("adapter",), ("adapter", ("img", 2))],
            group_idx=1,
        ),
        BlockRemoved(block_hashes=[H0], group_idx=1),  # type: ignore[list-item]
        AllBlocksCleared(),
    ]


def test_block_hash_is_the_low_64_bits_big_endian() -> None:
    h = bytes(range(32))
    assert external_block_hash(h) == int.from_bytes(h[-8:], "big")
    assert external_block_hash(h, use_int=False) == h
    assert external_block_hash(b"\xff" * 32) == 2**64 - 1


def _plain_store() -> BlockStored:
    """A store with every optional field unset: no LoRA, no extra keys, no group."""
    return BlockStored(
        block_hashes=[H2],  # type: ignore[list-item]
        parent_block_hash=None,
        token_ids=[7] * 4,
        block_size=4,
        group_idx=None,
    )


def _map_payload(**kw: Any) -> bytes:
    return MapCodec().encode(make_batch(_events(), **kw))


def _array_payload(**kw: Any) -> bytes:
    return ArrayCodec().encode(make_batch(_events(), **kw))


def test_raw_map_layout_is_keyed_and_tagged_by_type() -> None:
    """The "map" layout, pinned key for key and in order (msgpack maps keep order)."""
    raw = msgspec.msgpack.decode(_map_payload(ts=1.5))
    i = external_block_hash
    assert list(raw) == ["ts", "events", "data_parallel_rank"]
    assert (raw["ts"], raw["data_parallel_rank"]) == (1.5, 0)
    stored, removed, cleared = raw["events"]
    assert list(stored.items()) == [
        ("type", "BlockStored"),
        ("block_hashes", [i(H1), i(H2)]),
        ("parent_block_hash", i(H0)),
        ("token_ids", list(range(8))),
        ("block_size", 4),
        ("lora_id", None),
        ("medium", "GPU"),
        ("lora_name", "adapter"),
        ("extra_keys", [["adapter"], ["adapter", ["img", 2]]]),
        ("group_idx", 1),
    ]
    assert list(removed.items()) == [
        ("type", "BlockRemoved"),
        ("block_hashes", [i(H0)]),
        ("medium", "GPU"),
        ("group_idx", 1),
    ]
    assert cleared == {"type": "AllBlocksCleared"}
    assert make_codec().wire_format == "vllm"  # the default: vLLM 0.33.0's


def test_raw_map_layout_keeps_required_nulls_and_drops_unset_defaults() -> None:
    """`lora_name` has no default in vLLM: it must be there even when null."""
    raw = msgspec.msgpack.decode(
        MapCodec().encode(make_batch([_plain_store()], ts=0.0, data_parallel_rank=None))
    )
    assert raw == {
        "ts": 0.0,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [external_block_hash(H2)],
                "parent_block_hash": None,
                "token_ids": [7] * 4,
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        ],
    }


def test_raw_array_layout_is_positional_and_tagged() -> None:
    """The legacy layout, pinned: the bytes paged sent before maps became the default."""
    raw = msgspec.msgpack.decode(_array_payload(ts=1.5))
    i = external_block_hash
    assert raw == [
        1.5,
        [
            [
                "BlockStored",
                [i(H1), i(H2)],
                i(H0),
                list(range(8)),
                4,
                None,
                "GPU",
                "adapter",
                [["adapter"], ["adapter", ["img", 2]]],
                1,
            ],
            ["BlockRemoved", [i(H0)], "GPU", 1],
            ["AllBlocksCleared"],
        ],
        0,
    ]


def test_map_decoder_reads_every_field_of_the_map_stream() -> None:
    batch = msgspec.msgpack.Decoder(type=VllmKVEventBatch).decode(
        _map_payload(ts=2.0, data_parallel_rank=3)
    )
    assert batch.ts == 2.0 and batch.data_parallel_rank == 3
    stored, removed, cleared = batch.events
    assert isinstance(stored, VllmBlockStored)
    assert stored.block_hashes == [external_block_hash(H1), external_block_hash(H2)]
    assert stored.parent_block_hash == external_block_hash(H0)
    assert stored.token_ids == list(range(8))
    assert (stored.block_size, stored.lora_id, stored.medium, stored.lora_name) == (
        4,
        None,
        "GPU",
        "adapter",
    )
    assert stored.extra_keys == [("adapter",), ("adapter", ["img", 2])]
    assert stored.group_idx == 1
    # These events carry no spec (KVCacheManager.take_events adds it).
    assert stored.kv_cache_spec_kind is None and stored.kv_cache_spec_sliding_window is None
    assert isinstance(removed, VllmBlockRemoved)
    assert (removed.block_hashes, removed.medium, removed.group_idx) == (
        [external_block_hash(H0)],
        "GPU",
        1,
    )
    assert isinstance(cleared, VllmAllBlocksCleared)


def test_map_decoder_reads_a_store_without_lora_or_group() -> None:
    payload = MapCodec().encode(make_batch([_plain_store()], ts=0.0))
    (stored,) = msgspec.msgpack.Decoder(type=VllmKVEventBatch).decode(payload).events
    assert isinstance(stored, VllmBlockStored)
    assert (stored.lora_name, stored.group_idx, stored.extra_keys) == (None, None, None)


@pytest.mark.parametrize("use_int_hashes", [True, False])
def test_map_stream_is_the_bytes_its_decoders_encoder_writes(use_int_hashes: bool) -> None:
    """Re-encoding with vLLM's structs gives the same bytes: same keys, order, omissions."""
    for events in (_events(), [_plain_store()]):
        payload = MapCodec().encode(make_batch(events, ts=2.5, use_int_hashes=use_int_hashes))
        vllm_batch = msgspec.msgpack.Decoder(type=VllmKVEventBatch).decode(payload)
        assert msgspec.msgpack.encode(vllm_batch) == payload


def test_paged_map_decoder_reads_spec_metadata() -> None:
    """Stores carry the group's spec; paged's "map" subscriber keeps it."""
    vllm_batch = VllmKVEventBatch(
        ts=1.0,
        events=[
            VllmBlockStored(
                block_hashes=[5],
                parent_block_hash=None,
                token_ids=[1, 2],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128,
            )
        ],
    )
    (stored,) = MapCodec().decode(msgspec.msgpack.encode(vllm_batch)).events
    assert stored.kv_cache_spec_kind == "sliding_window"  # type: ignore[union-attr]
    assert stored.kv_cache_spec_sliding_window == 128  # type: ignore[union-attr]


def test_legacy_decoder_reads_every_field_of_the_array_stream() -> None:
    batch = msgspec.msgpack.Decoder(type=ArrayKVEventBatchV).decode(
        _array_payload(ts=2.0, data_parallel_rank=3)
    )
    assert batch.ts == 2.0 and batch.data_parallel_rank == 3
    stored, removed, cleared = batch.events
    assert isinstance(stored, ArrayBlockStoredV)
    assert stored.block_hashes == [external_block_hash(H1), external_block_hash(H2)]
    assert stored.parent_block_hash == external_block_hash(H0)
    assert stored.token_ids == list(range(8))
    assert (stored.block_size, stored.lora_id, stored.medium, stored.lora_name) == (
        4,
        None,
        "GPU",
        "adapter",
    )
    assert stored.extra_keys == [("adapter",), ("adapter", ["img", 2])]
    assert stored.group_idx == 1
    assert stored.kv_cache_spec_kind is None and stored.kv_cache_spec_sliding_window is None
    assert isinstance(removed, ArrayBlockRemovedV) and removed.group_idx == 1
    assert isinstance(cleared, ArrayAllBlocksClearedV)


def test_vllm_example_subscriber_decoder_reads_the_array_stream() -> None:
    batch = msgspec.msgpack.Decoder(type=OldKVEventBatch).decode(_array_payload(ts=2.0))
    assert [type(e) for e in batch.events] == [OldStored, OldRemoved, OldCleared]
    assert batch.events[0].medium == "GPU"  # type: ignore[union-attr]


def test_layouts_do_not_read_each_other() -> None:
    """Why both ends must name the same wire_format: msgspec does not cross over."""
    with pytest.raises(msgspec.ValidationError, match="Expected `object`, got `array`"):
        msgspec.msgpack.Decoder(type=VllmKVEventBatch).decode(_array_payload(ts=0.0))
    with pytest.raises(msgspec.ValidationError, match="Expected `array`, got `object`"):
        msgspec.msgpack.Decoder(type=ArrayKVEventBatchV).decode(_map_payload(ts=0.0))


@pytest.mark.parametrize("wire_format", ["vllm", "map", "array"])
def test_codecs_round_trip_bytes_hashes(wire_format: Any) -> None:
    codec = make_codec(wire_format)
    assert codec.wire_format == wire_format
    sent = make_batch(_events(), ts=0.0, use_int_hashes=False)
    batch = codec.decode(codec.encode(sent))
    assert isinstance(batch, KVEventBatch)
    assert batch.events[0].block_hashes == [H1, H2]  # type: ignore[union-attr]
    # Nested tuples in extra_keys come back as lists (msgpack has one array type).
    assert batch.events[0].extra_keys == [("adapter",), ("adapter", ["img", 2])]  # type: ignore[union-attr]
    assert sent.events[1:] == batch.events[1:]
    assert (batch.ts, batch.data_parallel_rank) == (0.0, 0)


def test_unknown_wire_format_names_the_field() -> None:
    with pytest.raises(
        ValueError, match="wire_format must be one of 'vllm', 'map', 'array', got 'xml'"
    ):
        make_codec("xml")  # type: ignore[arg-type]


def test_non_event_is_refused() -> None:
    with pytest.raises(TypeError, match="not a KV cache event"):
        make_batch(["BlockStored"], ts=0.0)  # type: ignore[list-item]


@pytest.mark.parametrize("seq", [0, 1, 255, 2**40, -1])
def test_sequence_frames_are_8_bytes_big_endian(seq: int) -> None:
    frame = encode_seq(seq)
    assert len(frame) == 8 and decode_seq(frame) == seq
    if seq >= 0:
        assert int.from_bytes(frame, "big") == seq
    assert decode_seq(END_OF_REPLAY) == -1 and END_OF_REPLAY == b"\xff" * 8
