"""vLLM 0.33.0's KV event wire structs and the conversion from paged.kvcache events.

A message on the PUB socket is three frames: `topic`, the batch's sequence
number (8 bytes, big-endian, unsigned) and the msgpack of one `KVEventBatch`.
The structs here are vLLM 0.33.0's (vllm/distributed/kv_events.py:31-149),
declared in vLLM's field order with vLLM's struct options:

- the batch is `array_like=True` (kv_events.py:31-39): a msgpack array
  `[ts, events, data_parallel_rank]`, every field written (msgspec's
  `omit_defaults` does not act on array-like structs);
- events are not array-like (kv_events.py:42-48): a msgpack map keyed by
  field name, `tag=True` (the key "type", first, holds the class name),
  `omit_defaults=True` (a field equal to its default is left off; fields
  without a default are always there, null or not).

So a batch reads

    [1.5, [
        {"type": "BlockStored", "block_hashes": [h0, h1], "parent_block_hash": p,
         "token_ids": [...], "block_size": 16, "lora_id": null, "medium": "GPU",
         "lora_name": null, "extra_keys": [null, null], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"}],
     0]

and is the same bytes vLLM 0.33.0's encoder writes for those values, so
vLLM's own decoder (`msgspec.msgpack.Decoder(KVEventBatch)`) reads it. This
is `wire_format: "vllm"`, the default; paged's earlier layouts are in
`wire_map.py` ("map") and `wire_array.py` ("array"); `codec.py` picks one.

Block hashes leave as vLLM's `ExternalBlockHash`: by default the 64-bit int
`int.from_bytes(hash, "big") & (2**64 - 1)` (vLLM's default,
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), else the raw hash bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from paged.kvcache.events import AllBlocksCleared as KVAllBlocksCleared
from paged.kvcache.events import BlockRemoved as KVBlockRemoved
from paged.kvcache.events import BlockStored as KVBlockStored
from paged.kvcache.events import KVCacheEvent as KVKVCacheEvent

# The hash's bytes or an int (the default): vLLM's `ExternalBlockHash`
# (vllm/v1/core/kv_cache_utils.py:57).
ExternalBlockHash = bytes | int

_LOW_64_BITS = (1 << 64) - 1


def external_block_hash(block_hash: bytes, use_int: bool = True) -> ExternalBlockHash:
    """The published form of a block hash: its low 64 bits as an int, or the bytes."""
    if not use_int:
        return bytes(block_hash)
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped list of events; `data_parallel_rank` names the publishing engine.

    `array_like` as in vLLM 0.33.0 (kv_events.py:31-39): `[ts, events, rank]`.
    """

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the event structs; the tag (field "type") is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    # No default, as in vLLM: always on the wire, so vLLM's decoder (which
    # requires it) reads a store without a LoRA.
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # LOCAL or REMOTE relative to the publisher; an offload tier's id; the
    # session behind a store; tokens past each block used in its hash.
    # paged sets locality/ownership for its Redis tier ("REMOTE", "redis") only.
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[WireEvent]  # narrows EventBatch's list[Any], as vLLM's does


def to_wire_event(event: KVKVCacheEvent, use_int_hashes: bool = True) -> WireEvent:
    """The wire struct of one paged.kvcache event (`TypeError` for anything else)."""
    if isinstance(event, KVBlockStored):
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=[external_block_hash(h, use_int_hashes) for h in event.block_hashes],
            parent_block_hash=None
            if parent is None
            else external_block_hash(parent, use_int_hashes),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            locality=event.locality,
            ownership=event.ownership,
            session_id=event.session_id,
            lookahead_token_ids=event.lookahead_token_ids,
        )
    if isinstance(event, KVBlockRemoved):
        return BlockRemoved(
            block_hashes=[external_block_hash(h, use_int_hashes) for h in event.block_hashes],
            medium=event.medium,
            group_idx=event.group_idx,
            locality=event.locality,
            ownership=event.ownership,
        )
    if isinstance(event, KVAllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a KV cache event: {event!r}")


def make_batch(
    events: Iterable[KVKVCacheEvent],
    ts: float,
    data_parallel_rank: int | None = 0,
    use_int_hashes: bool = True,
) -> KVEventBatch:
    """One `KVEventBatch` holding `events` in order."""
    return KVEventBatch(
        ts=ts,
        events=[to_wire_event(e, use_int_hashes) for e in events],
        data_parallel_rank=data_parallel_rank,
    )


def encode_seq(seq: int) -> bytes:
    """A sequence number as its 8-byte big-endian frame (-1: the end-of-replay marker)."""
    return seq.to_bytes(8, "big", signed=seq < 0)


def decode_seq(frame: bytes) -> int:
    """The sequence number in an 8-byte frame (the end-of-replay marker reads -1)."""
    if len(frame) != 8:
        raise ValueError(f"a sequence number frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


END_OF_REPLAY = encode_seq(-1)
