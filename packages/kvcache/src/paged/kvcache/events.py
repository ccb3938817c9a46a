"""KV cache events, emitted by `BlockPool` when `enable_kv_cache_events` is set.

Connectors and external indexes (e.g. a router that knows which engine holds
which prefix) consume them through `KVCacheManager.take_events()`. Hashes are
`BlockHash` values, i.e. without the group id suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.kvcache.ids import BlockHash

# vLLM's medium names (vllm/distributed/kv_events.py:51-53).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


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

    The fields after `group_idx` are vLLM 0.33.0's (vllm/distributed/kv_events.py:83-98).
    `kv_cache_spec_kind` / `kv_cache_spec_sliding_window` describe the group's
    spec; the block pool does not know it, so `KVCacheManager.take_events`
    fills them in (as vLLM's kv_cache_manager.py:705-730 does). `locality` and
    `ownership` are set only by the OffloadingConnector's Redis tier ("REMOTE",
    "redis"); `session_id` and `lookahead_token_ids` stay None: paged has no
    sessions or lookahead hashing.
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
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block's hash left the prefix cache (one event per evicted block).

    `group_idx` names the KV cache group the block served: a hybrid model
    caches the same hash once per group (e.g. full and sliding window), and a
    consumer must know which copy went while the other may stay cached.
    `locality` / `ownership` are vLLM 0.33.0's (kv_events.py:128-130); paged
    leaves them None.
    """

    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """`reset_prefix_cache()` dropped every cached hash."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
