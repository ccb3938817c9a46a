"""KV cache events published as vLLM does: ZMQ PUB + ROUTER replay, vLLM's msgpack layout.

engine core --publish(step events)--> EventPublisher --thread--> PUB  (topic, seq, batch)
                                                               ROUTER (replay from seq N)
KVEventSubscriber (SUB + DEALER) --> CachedBlockIndex (hashes the engine holds)
"""

from paged.connectors.events.config import (
    KVEventsConfig,
    KVEventsConfigError,
    parse_kv_events_config,
)
from paged.connectors.events.publisher import (
    EventPublisher,
    NullEventPublisher,
    ZmqEventPublisher,
    make_event_publisher,
)
from paged.connectors.events.subscriber import CachedBlockIndex, KVEventSubscriber
from paged.connectors.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    external_block_hash,
    make_batch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CachedBlockIndex",
    "EventPublisher",
    "KVEventBatch",
    "KVEventSubscriber",
    "KVEventsConfig",
    "KVEventsConfigError",
    "NullEventPublisher",
    "ZmqEventPublisher",
    "external_block_hash",
    "make_batch",
    "make_event_publisher",
    "parse_kv_events_config",
]
