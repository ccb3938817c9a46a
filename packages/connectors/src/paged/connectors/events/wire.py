"""vLLM's KV event wire structs and the conversion from paged.kvcache events.

A message on the PUB socket is three frames: `topic`, the batch's sequence
number (8 bytes, big-endian, unsigned) and the msgpack of one `KVEventBatch`.
The structs here are current vLLM's (`vllm/distributed/kv_events.py`),
declared in vLLM's field order with vLLM's struct options: no `array_like`
(a struct is a msgpack map keyed by field name), `omit_defaults=True` (a
field equal to its default is left off; fields without a default are always
there, null or not), `tag=True` on events (the tag field `"type"` holds the
class name, first in the map). So a batch reads

    {"ts": 1.5, "events": [
        {"type": "BlockStored", "block_hashes": [h0, h1], "parent_block_hash": p,
         "token_ids": [...], "block_size": 16, "lora_id": null, "medium": "GPU",
         "lora_name": null, "extra_keys": [null, null], "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"}],
     "data_parallel_rank": 0}

and is the same bytes vLLM's encoder writes for those values, so any decoder
declared from vLLM's definitions reads it. `kv_cache_spec_kind` and
`kv_cache_spec_sliding_window` are declared (so paged decodes vLLM streams
that carry them) but paged never sets them: paged.kvcache events do not say
which KV cache spec their group has, so they stay None and are left off.

The positional layout of vLLM 0.2x and before (`wire_format: "array"`) is in
`wire_array.py`; `codec.py` picks one of the two.

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

# An int (the default) or the hash's bytes: vLLM's `ExternalBlockHash`.
ExternalBlockHash = int | bytes

_LOW_64_BITS = (1 << 64) - 1


def external_block_hash(block_hash: bytes, use_int: bool = True) -> ExternalBlockHash:
    """The published form of a block hash: its low 64 bits as an int, or the bytes."""
    if not use_int:
        return bytes(block_hash)
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """A timestamped list of events; `data_parallel_rank` names the publishing engine."""

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
    # Never set by paged (see the module docstring); read from vLLM streams.
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


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
        )
    if isinstance(event, KVBlockRemoved):
        return BlockRemoved(
            block_hashes=[external_block_hash(h, use_int_hashes) for h in event.block_hashes],
            medium=event.medium,
            group_idx=event.group_idx,
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
