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

    Fields, names and order are vLLM's `BlockStored` (its msgspec wire struct
    encodes them by name). `parent_block_hash` is the hash of the block before
    the first stored one (None when the first stored block is the request's
    block 0); `token_ids` are the tokens of all stored blocks, concatenated.
    `extra_keys[i]` are the extra keys of `block_hashes[i]` in vLLM's published
    (untagged) form: the LoRA name, `(identifier, offset)` per mm item, the
    cache salt; None for a block without any (see `published_extra_keys`).
    `group_idx` is the KV cache group that cached the blocks. `lora_id` is
    always None: requests name their adapter, they carry no integer id.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block's hash left the prefix cache (one event per evicted block).

    `group_idx` names the KV cache group the block served: a hybrid model
    caches the same hash once per group (e.g. full and sliding window), and a
    consumer must know which copy went while the other may stay cached.
    """

    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """`reset_prefix_cache()` dropped every cached hash."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
