"""`BatchCodec`: a `KVEventBatch` to and from the bytes of one wire layout.

Publisher and subscriber hold one each, for the `wire_format` they were
given; both sides of a stream must use the same one (msgspec's map decoder
refuses arrays and the other way round):

| wire_format | batch | events | structs | who decodes it |
|---|---|---|---|---|
| "vllm" (default) | array `[ts, events, rank]` | maps, tagged | `wire.py` | vLLM 0.33.0 |
| "map" | map `{"ts", "events", ...}` | maps, tagged | `wire_map.py` | paged before |
| "array" | array | arrays, `[tag, field...]` | `wire_array.py` | vLLM 0.2x |

("paged before": paged's default until it followed vLLM 0.33.0.)

In code a batch is always `wire.KVEventBatch`; the other codecs convert on
the way (on the publisher's thread, never the engine's).
A codec is not thread-safe (its msgspec encoder and decoder are not).
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from paged.connectors.events.config import WIRE_FORMATS, WireFormat
from paged.connectors.events.wire import KVEventBatch
from paged.connectors.events.wire_array import (
    ArrayKVEventBatch,
    from_array_batch,
    to_array_batch,
)
from paged.connectors.events.wire_map import MapKVEventBatch, from_map_batch, to_map_batch


class BatchCodec(Protocol):
    """Encodes and decodes batches in one layout, named by `wire_format`.

    `decode` raises `msgspec.DecodeError` (its `ValidationError` included)
    for bytes that are not a batch in this layout.
    """

    wire_format: WireFormat

    def encode(self, batch: KVEventBatch) -> bytes: ...

    def decode(self, payload: bytes) -> KVEventBatch: ...


class VllmCodec:
    """vLLM 0.33.0's layout: the structs of `wire.py`, encoded as they are."""

    wire_format: WireFormat = "vllm"

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def encode(self, batch: KVEventBatch) -> bytes:
        return self._encoder.encode(batch)

    def decode(self, payload: bytes) -> KVEventBatch:
        return self._decoder.decode(payload)


class MapCodec:
    """paged's earlier default: the batch a map, events as in "vllm" (`wire_map.py`)."""

    wire_format: WireFormat = "map"

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(type=MapKVEventBatch)

    def encode(self, batch: KVEventBatch) -> bytes:
        return self._encoder.encode(to_map_batch(batch))

    def decode(self, payload: bytes) -> KVEventBatch:
        return from_map_batch(self._decoder.decode(payload))


class ArrayCodec:
    """vLLM 0.2x's positional layout, through the structs of `wire_array.py`."""

    wire_format: WireFormat = "array"

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(type=ArrayKVEventBatch)

    def encode(self, batch: KVEventBatch) -> bytes:
        return self._encoder.encode(to_array_batch(batch))

    def decode(self, payload: bytes) -> KVEventBatch:
        return from_array_batch(self._decoder.decode(payload))


def make_codec(wire_format: WireFormat = "vllm") -> BatchCodec:
    """The codec of `wire_format` (`ValueError` naming the field for anything else)."""
    if wire_format == "vllm":
        return VllmCodec()
    if wire_format == "map":
        return MapCodec()
    if wire_format == "array":
        return ArrayCodec()
    raise ValueError(
        f"wire_format must be one of {', '.join(map(repr, WIRE_FORMATS))}, got {wire_format!r}"
    )
