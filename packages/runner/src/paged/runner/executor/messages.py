"""Typed executor -> worker calls and worker -> executor replies (msgspec msgpack).

Every call a worker understands is one tagged Struct; the worker dispatches
on the type, never on a method-name string, and decoding rejects anything
else. Replies carry the result msgpack-encoded (typed by the call) or the
worker's error text.

KV cache specs are frozen dataclasses with subclasses; msgpack cannot tell
them apart, so they travel as `SpecWire(kind, fields)` and are rebuilt from
an explicit table of the `paged.kvcache` spec classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from paged.kvcache import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from paged.runner.lora.config import LoRAAdapterSpec
from paged.scheduler.boundary import GrammarOutput, ModelRunnerOutput, SchedulerOutput

_SPEC_CLASSES: dict[str, type[KVCacheSpec]] = {
    cls.__name__: cls
    for cls in (
        FullAttentionSpec,
        SlidingWindowSpec,
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        MLAAttentionSpec,
        SinkFullAttentionSpec,
        MambaSpec,
    )
}


class SpecWire(msgspec.Struct, array_like=True, frozen=True):
    kind: str
    fields: dict[str, Any]


class GroupWire(msgspec.Struct, array_like=True, frozen=True):
    layer_names: list[str]
    spec: SpecWire


class KVCacheConfigWire(msgspec.Struct, array_like=True, frozen=True):
    num_blocks: int
    tensors: list[tuple[int, list[str]]]
    groups: list[GroupWire]


def spec_to_wire(spec: KVCacheSpec) -> SpecWire:
    kind = type(spec).__name__
    if kind not in _SPEC_CLASSES:
        raise ValueError(f"KV cache spec {kind} cannot be sent to a worker")
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return SpecWire(kind, fields)


def spec_from_wire(wire: SpecWire) -> KVCacheSpec:
    cls = _SPEC_CLASSES.get(wire.kind)
    if cls is None:
        raise ValueError(f"unknown KV cache spec kind {wire.kind!r}")
    return msgspec.convert(wire.fields, type=cls)


def kv_config_to_wire(config: KVCacheConfig) -> KVCacheConfigWire:
    return KVCacheConfigWire(
        num_blocks=config.num_blocks,
        tensors=[(t.size, list(t.shared_by)) for t in config.kv_cache_tensors],
        groups=[
            GroupWire(list(g.layer_names), spec_to_wire(g.kv_cache_spec))
            for g in config.kv_cache_groups
        ],
    )


def kv_config_from_wire(wire: KVCacheConfigWire) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=wire.num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=s, shared_by=names) for s, names in wire.tensors],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=g.layer_names, kv_cache_spec=spec_from_wire(g.spec))
            for g in wire.groups
        ],
    )


# ----------------------------------------------------------------- calls


class ExecuteModel(msgspec.Struct, tag=True, array_like=True, frozen=True):
    scheduler_output: SchedulerOutput


class SampleTokens(msgspec.Struct, tag=True, array_like=True, frozen=True):
    grammar_output: GrammarOutput | None = None


class GetKVCacheSpec(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


class DetermineAvailableMemory(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


class InitializeFromConfig(msgspec.Struct, tag=True, array_like=True, frozen=True):
    kv_cache_config: KVCacheConfigWire


class CheckHealth(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


class AddLoRA(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Load a LoRA adapter; the result is None or the reason it was refused (str)."""

    spec: LoRAAdapterSpec


class RemoveLoRA(msgspec.Struct, tag=True, array_like=True, frozen=True):
    name: str


class ListLoRAs(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


class Shutdown(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


class Crash(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Test hook: the worker process exits at once with `exit_code` (simulates a crash)."""

    exit_code: int = 1


WorkerCall = (
    ExecuteModel
    | SampleTokens
    | GetKVCacheSpec
    | DetermineAvailableMemory
    | InitializeFromConfig
    | CheckHealth
    | AddLoRA
    | RemoveLoRA
    | ListLoRAs
    | Shutdown
    | Crash
)


class Reply(msgspec.Struct, array_like=True, frozen=True):
    """A worker's answer: `result` (msgpack of the call's result type) or `error`."""

    rank: int
    result: bytes = b""
    error: str | None = None


class Ready(msgspec.Struct, array_like=True, frozen=True):
    """Sent once by a worker after start-up (or its start-up error)."""

    rank: int
    pid: int
    error: str | None = None


_ENCODER = msgspec.msgpack.Encoder()
_CALL_DECODER = msgspec.msgpack.Decoder(WorkerCall)
_REPLY_DECODER = msgspec.msgpack.Decoder(Reply)
_READY_DECODER = msgspec.msgpack.Decoder(Ready)


def encode(obj: Any) -> bytes:
    return _ENCODER.encode(obj)


def decode_call(data: bytes) -> WorkerCall:
    call: WorkerCall = _CALL_DECODER.decode(data)
    return call


def decode_reply(data: bytes) -> Reply:
    return _REPLY_DECODER.decode(data)


def decode_ready(data: bytes) -> Ready:
    return _READY_DECODER.decode(data)


def encode_result(call: WorkerCall, value: Any) -> bytes:
    """Encode a call's result; specs are wrapped in `SpecWire`."""
    if isinstance(call, GetKVCacheSpec):
        return _ENCODER.encode({name: spec_to_wire(s) for name, s in value.items()})
    return _ENCODER.encode(value)


def decode_result(call: WorkerCall, data: bytes) -> Any:
    """Decode a call's result with the type that call returns."""
    if isinstance(call, GetKVCacheSpec):
        wires = msgspec.msgpack.decode(data, type=dict[str, SpecWire])
        return {name: spec_from_wire(w) for name, w in wires.items()}
    if isinstance(call, ExecuteModel):
        return msgspec.msgpack.decode(data, type=ModelRunnerOutput | None)
    if isinstance(call, SampleTokens):
        return msgspec.msgpack.decode(data, type=ModelRunnerOutput)
    if isinstance(call, DetermineAvailableMemory):
        return msgspec.msgpack.decode(data, type=int)
    if isinstance(call, AddLoRA):
        return msgspec.msgpack.decode(data, type=str | None)
    if isinstance(call, RemoveLoRA):
        return msgspec.msgpack.decode(data, type=bool)
    if isinstance(call, ListLoRAs):
        return msgspec.msgpack.decode(data, type=list[str])
    return msgspec.msgpack.decode(data, type=None)
