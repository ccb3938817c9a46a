"""The scheduler side's per-step orders to the worker side (msgpack, structs only)."""

from __future__ import annotations

import enum

import msgspec


class Tier(enum.IntEnum):
    HOST = 0
    DISK = 1
    REDIS = 2  # shared by engines (redis_tier.py)


class ChunkLoad(msgspec.Struct, array_like=True, frozen=True):
    """Copy blocks `first_block .. first_block + len(block_ids)` of chunk `key` into `block_ids`.

    `first_block` > 0 when the request's local prefix-cache hit ends inside
    the chunk: those blocks are already in the paged cache (possibly shared
    with running requests) and are not written again. `promote`: a disk or
    Redis hit that also goes into host memory. `group`: the KV cache group whose
    layers the chunk holds (hybrid models store one chunk per group).
    """

    key: str
    source: Tier
    block_ids: list[int]
    first_block: int = 0
    promote: bool = False
    group: int = 0


class ChunkSave(msgspec.Struct, array_like=True, frozen=True):
    """Copy these blocks (all of one chunk, in order) out of `group`'s layers of the paged cache."""

    key: str
    block_ids: list[int]
    to_host: bool
    to_disk: bool
    to_redis: bool = False
    group: int = 0


class OffloadingMetadata(msgspec.Struct, array_like=True, frozen=True):
    """One step: evictions first (they free room for this step's saves), then loads, saves."""

    loads: list[ChunkLoad] = msgspec.field(default_factory=list)
    saves: list[ChunkSave] = msgspec.field(default_factory=list)
    evict_host: list[str] = msgspec.field(default_factory=list)
    evict_disk: list[str] = msgspec.field(default_factory=list)
