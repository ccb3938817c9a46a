"""The positional (array) wire layout of vLLM 0.2x and before, for older consumers.

Until vLLM dropped `array_like=True` from its event structs, a batch was a
msgpack array, fields by position (msgspec writes every field of an
array-like struct: `omit_defaults` only acts on maps), and an event
`[class name, field...]`:

    [ts, [["BlockStored", [h0, h1], parent, [tok...], 16, null, "GPU", null, [null, null], 0],
          ["BlockRemoved", [h], "GPU", 0],
          ["AllBlocksCleared"]], 0]

paged sends this when `--kv-events-config` has `"wire_format": "array"`:
the same bytes paged sent before maps became its default. The structs are
`wire.py`'s with `array_like=True`, same names and order, minus the fields
vLLM added after `group_idx` (`kv_cache_spec_kind` onwards): leaving them out
keeps the legacy bytes as they were, since msgspec writes every field of an
array-like struct (an array decoder declaring them still reads the stream:
it gets their defaults). `lora_name` keeps a
default, so streams of releases that ended before it still decode. A
decoder with fewer trailing fields (vLLM's old example subscriber) reads it.

msgspec's map decoder refuses an array and the other way round, so both ends
must agree on the layout: there is no sniffing.
"""

from __future__ import annotations

from typing import Any

import msgspec

from paged.connectors.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    WireEvent,
)


class ArrayEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the array event structs; tags are vLLM's class names, given explicitly."""


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


ArrayWireEvent = ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared


class ArrayKVEventBatch(ArrayEventBatch):
    events: list[ArrayWireEvent]


def to_array_event(event: WireEvent) -> ArrayWireEvent:
    """The array-layout struct of `event` (fields past `group_idx` dropped, see above)."""
    if isinstance(event, BlockStored):
        return ArrayBlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
        )
    if isinstance(event, BlockRemoved):
        return ArrayBlockRemoved(event.block_hashes, event.medium, event.group_idx)
    return ArrayAllBlocksCleared()


def from_array_event(event: ArrayWireEvent) -> WireEvent:
    """The map-layout struct (`wire.py`) holding the same fields as `event`."""
    if isinstance(event, ArrayBlockStored):
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
        )
    if isinstance(event, ArrayBlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium, event.group_idx)
    return AllBlocksCleared()


def to_array_batch(batch: KVEventBatch) -> ArrayKVEventBatch:
    return ArrayKVEventBatch(
        ts=batch.ts,
        events=[to_array_event(e) for e in batch.events],
        data_parallel_rank=batch.data_parallel_rank,
    )


def from_array_batch(batch: ArrayKVEventBatch) -> KVEventBatch:
    return KVEventBatch(
        ts=batch.ts,
        events=[from_array_event(e) for e in batch.events],
        data_parallel_rank=batch.data_parallel_rank,
    )
