"""KV cache events of the offloading tiers (`take_events()` of the scheduler side).

vLLM's OffloadingConnector publishes what its OffloadingManager decides, with
`medium` "CPU" for host memory (and the backend's medium for others); paged
names its tiers the same way: host -> "CPU", disk -> "STORAGE" (vLLM's
MEDIUM_STORAGE).

A chunk announced as stored carries the hashes of its blocks in order, as the
device pool publishes the same blocks (`BlockHash` bytes; the wire turns them
into vLLM's external form), so a router can match one block across tiers:

    block hashes (pool, GPU)   h0 h1 h2 h3 | h4 h5 h6 h7        blocks_per_chunk = 4
    chunk 1 stored in a tier               | h4 h5 h6 h7       parent h3, tokens 16..31

A chunk found on disk at start-up is known only by its key (the hash of its
last block: the file name), so it is announced with that one hash and no
tokens, vLLM's placeholder form. Removal repeats the hashes the chunk was
announced with, so a subscriber's multiset for each medium returns to empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from paged.connectors.kv.offloading.chunks import ChunkKey, split_group_key
from paged.connectors.kv.offloading.metadata import Tier
from paged.kvcache import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    generate_block_hash_extra_keys,
    need_extra_keys,
    published_extra_keys,
)
from paged.scheduler.request import Request

# vLLM 0.33.0's names (kv_events.py:51-53; offloading/events.py:58-61).
TIER_MEDIUM = {Tier.HOST: MEDIUM_CPU, Tier.DISK: MEDIUM_STORAGE, Tier.REDIS: MEDIUM_STORAGE}
# vLLM 0.33's `locality` / `ownership` of a secondary tier's events (kv_events.py:88-91):
# the Redis tier is remote storage, owned by "redis". Its chunks are not tracked in
# `announced`: Redis evicts on its own and other engines write it, so no removal is known.
_REMOTE_TIERS = {Tier.REDIS: ("REMOTE", "redis")}


class TierEvents:
    """Events of every tier since the last `take()`, and the hashes each tier announced.

    Invariant: `announced(tier)` holds exactly the keys of that tier's index
    (the scheduler side calls `stored` for every insert and `removed` for
    every eviction or drop), each with the hashes its `BlockStored` carried.
    """

    def __init__(
        self, block_size: int, blocks_per_chunk: int, quiet: frozenset[Tier] = frozenset()
    ) -> None:
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        # Tiers whose events are not published (vLLM's fs tier without enable_kv_events);
        # what they hold is still tracked, so `announced` stays the tier's contents.
        self.quiet = quiet
        self._queue: list[KVCacheEvent] = []
        self._announced: dict[Tier, dict[ChunkKey, list[BlockHash]]] = {t: {} for t in Tier}

    def stored(
        self, tier: Tier, key: ChunkKey, request: Request, chunk_idx: int, group: int = 0
    ) -> None:
        """Chunk `chunk_idx` of `request`'s KV cache group `group` (key `key`) is now in `tier`."""
        bpc, bs = self.blocks_per_chunk, self.block_size
        first = chunk_idx * bpc
        hashes = [BlockHash(h) for h in request.block_hashes[first : first + bpc]]
        start, end = first * bs, (first + bpc) * bs
        locality, ownership = _REMOTE_TIERS.get(tier, (None, None))
        if locality is None:
            self._announced[tier][key] = hashes
        self._publish(
            tier,
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=BlockHash(request.block_hashes[first - 1]) if first else None,
                token_ids=list(request.all_token_ids[start:end]),
                block_size=bs,
                medium=TIER_MEDIUM[tier],
                lora_name=request.lora_name,
                extra_keys=self._extra_keys(request, start),
                group_idx=group,
                locality=locality,
                ownership=ownership,
            ),
        )

    def stored_by_key(self, tier: Tier, keys: Iterable[ChunkKey]) -> None:
        """Chunks found at start-up: only their keys are known (see the module docstring)."""
        for key in keys:
            block_hash, group = split_group_key(key)
            hashes = [BlockHash(block_hash)]
            self._announced[tier][key] = hashes
            self._publish(
                tier,
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=self.block_size * self.blocks_per_chunk,
                    medium=TIER_MEDIUM[tier],
                    group_idx=group,
                ),
            )

    def removed(self, tier: Tier, keys: Iterable[ChunkKey]) -> None:
        """These chunks left `tier` (evicted, or dropped after a load error)."""
        for key in keys:
            hashes = self._announced[tier].pop(key, None)
            if hashes is not None:  # never announced: nothing for a subscriber to forget
                self._publish(
                    tier,
                    BlockRemoved(
                        block_hashes=hashes,
                        medium=TIER_MEDIUM[tier],
                        group_idx=split_group_key(key)[1],
                    ),
                )

    def _publish(self, tier: Tier, event: KVCacheEvent) -> None:
        if tier not in self.quiet:
            self._queue.append(event)

    def announced(self, tier: Tier) -> dict[ChunkKey, list[BlockHash]]:
        """What subscribers were told `tier` holds: chunk key -> block hashes (a copy)."""
        return dict(self._announced[tier])

    def take(self) -> Sequence[KVCacheEvent]:
        events, self._queue = self._queue, []
        return events

    def _extra_keys(self, request: Request, start: int) -> list[tuple[object, ...] | None]:
        # The device pool's form: one entry per block, None for a block without any.
        if not need_extra_keys(request):
            return [None] * self.blocks_per_chunk
        keys: list[tuple[object, ...] | None] = []
        mm_idx = 0
        for i in range(self.blocks_per_chunk):
            begin = start + i * self.block_size
            tagged, mm_idx = generate_block_hash_extra_keys(
                request, begin, begin + self.block_size, mm_idx
            )
            keys.append(published_extra_keys(tagged))
        return keys
