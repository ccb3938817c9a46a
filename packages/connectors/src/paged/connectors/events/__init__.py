"""KV cache events published as vLLM does: ZMQ PUB + ROUTER replay, vLLM's msgpack layout.

engine core --publish(step events)--> EventPublisher --thread--> PUB  (topic, seq, batch)
                                                               ROUTER (replay from seq N)
KVEventSubscriber (SUB + DEALER) --> CachedBlockIndex (hashes the engine holds)

The batch layout is vLLM 0.33.0's (`[ts, events, rank]`, events as tagged
maps) unless `wire_format` says "map" (paged's earlier all-maps layout) or
"array" (vLLM 0.2x's positional structs); see `codec.py`.
"""

from paged.connectors.events.codec import BatchCodec, make_codec
from paged.connectors.events.config import (
    WIRE_FORMATS,
    KVEventsConfig,
    KVEventsConfigError,
    WireFormat,
    parse_kv_events_config,
)
from paged.connectors.events.publisher import (
    EventPublisher,
    NullEventPublisher,
    ZmqEventPublisher,
    make_event_publisher,
)
from paged.connectors.events.subscriber import (
    CachedBlockIndex,
    KVEventDecodeError,
    KVEventSubscriber,
)
from paged.connectors.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    external_block_hash,
    make_batch,
)

__all__ = [
    "WIRE_FORMATS",
    "AllBlocksCleared",
    "BatchCodec",
    "BlockRemoved",
    "BlockStored",
    "CachedBlockIndex",
    "EventPublisher",
    "KVEventBatch",
    "KVEventDecodeError",
    "KVEventSubscriber",
    "KVEventsConfig",
    "KVEventsConfigError",
    "NullEventPublisher",
    "WireFormat",
    "ZmqEventPublisher",
    "external_block_hash",
    "make_batch",
    "make_codec",
    "make_event_publisher",
    "parse_kv_events_config",
]
