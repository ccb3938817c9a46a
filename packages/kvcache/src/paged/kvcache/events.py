"""KV cache events, emitted by `BlockPool` when `enable_kv_cache_events` is set.

Connectors and external indexes (e.g. a router that knows which engine holds
which prefix) consume them through `KVCacheManager.take_events()`. Hashes are
`BlockHash` values, i.e. without the group id suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.kvcache.ids import BlockHash

MEDIUM_GPU = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly registered in the prefix cache by one `cache_full_blocks` call.

    `parent_block_hash` is the hash of the block before the first stored one
    (None when the first stored block is the request's block 0); `token_ids`
    are the tokens of all stored blocks, concatenated.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    kv_cache_group_id: int = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block's hash left the prefix cache (one event per evicted block)."""

    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """`reset_prefix_cache()` dropped every cached hash."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
