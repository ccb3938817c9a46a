"""The all-maps wire layout paged published by default before it followed vLLM 0.33.0.

The events are `wire.py`'s (maps tagged by "type", defaults omitted); only
the batch differs: a msgpack map `{"ts": ..., "events": [...],
"data_parallel_rank": ...}` instead of vLLM 0.33.0's array
`[ts, events, data_parallel_rank]`. vLLM 0.33.0's decoder refuses it
("Expected `array`, got `object`"); paged sends it only when
`--kv-events-config` has `"wire_format": "map"`, for consumers written
against paged's earlier default.
"""

from __future__ import annotations

import msgspec

from paged.connectors.events.wire import KVEventBatch, WireEvent


class MapKVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


def to_map_batch(batch: KVEventBatch) -> MapKVEventBatch:
    return MapKVEventBatch(batch.ts, batch.events, batch.data_parallel_rank)


def from_map_batch(batch: MapKVEventBatch) -> KVEventBatch:
    return KVEventBatch(batch.ts, batch.events, batch.data_parallel_rank)
