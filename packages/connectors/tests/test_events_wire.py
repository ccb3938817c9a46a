"""The wire layout is vLLM's: decoders declared from vLLM's struct definitions read it.

The `Vllm*` structs below are written from vLLM's published definitions
(`vllm/distributed/kv_events.py`, field order and struct options), not
imported from paged, so a change of field order or options here fails.
"""

from typing import Any

import msgspec
import pytest

from paged.connectors.events.wire import (
    END_OF_REPLAY,
    KVEventBatch,
    decode_seq,
    encode_seq,
    external_block_hash,
    make_batch,
)
from paged.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredV(VllmKVCacheEvent, tag="BlockStored"):
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


class BlockRemovedV(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksClearedV(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[BlockStoredV | BlockRemovedV | AllBlocksClearedV]


# The decoder of vLLM's examples/online_serving/kv_events_subscriber.py (fewer fields).
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


def test_raw_layout_is_positional_and_tagged() -> None:
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(make_batch(_events(), ts=1.5)))
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


def test_vllm_decoder_reads_every_field() -> None:
    payload = msgspec.msgpack.encode(make_batch(_events(), ts=2.0, data_parallel_rank=3))
    batch = msgspec.msgpack.Decoder(type=VllmKVEventBatch).decode(payload)
    assert batch.ts == 2.0 and batch.data_parallel_rank == 3
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStoredV)
    assert stored.block_hashes == [external_block_hash(H1), external_block_hash(H2)]
    assert stored.parent_block_hash == external_block_hash(H0)
    assert (stored.block_size, stored.medium, stored.lora_name, stored.group_idx) == (
        4,
        "GPU",
        "adapter",
        1,
    )
    assert stored.extra_keys == [("adapter",), ("adapter", ["img", 2])]
    assert isinstance(removed, BlockRemovedV) and removed.group_idx == 1
    assert isinstance(cleared, AllBlocksClearedV)


def test_vllm_example_subscriber_decoder_reads_it() -> None:
    payload = msgspec.msgpack.encode(make_batch(_events(), ts=2.0))
    batch = msgspec.msgpack.Decoder(type=OldKVEventBatch).decode(payload)
    assert [type(e) for e in batch.events] == [OldStored, OldRemoved, OldCleared]
    assert batch.events[0].medium == "GPU"  # type: ignore[union-attr]


def test_paged_decoder_round_trips_bytes_hashes() -> None:
    payload = msgspec.msgpack.encode(make_batch(_events(), ts=0.0, use_int_hashes=False))
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    assert batch.events[0].block_hashes == [H1, H2]  # type: ignore[union-attr]
    # Nested tuples in extra_keys come back as lists (msgpack has one array type).
    assert make_batch(_events(), ts=0.0, use_int_hashes=False).events[1:] == batch.events[1:]


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
