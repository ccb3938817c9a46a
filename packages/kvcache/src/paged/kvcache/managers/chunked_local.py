"""`ChunkedLocalAttentionManager`: tokens attend only within their chunk."""

from __future__ import annotations

from collections.abc import Sequence

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.block_pool import BlockPool
from paged.kvcache.ids import BlockHash
from paged.kvcache.managers.base import SingleTypeKVCacheManager
from paged.kvcache.specs import ChunkedLocalAttentionSpec, KVCacheSpec


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Frees whole chunks once passed; earlier chunks count as computed.

    With chunk 8 and 13 computed tokens, token 13 attends to tokens 8..13, so
    chunk [0, 8) is skipped. A lookup pads positions before the current chunk
    with null blocks: those tokens count as computed even with an empty cache,
    since no later token reads them.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
    ) -> None:
        if not isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):
            raise ValueError(
                "ChunkedLocalAttentionManager needs a ChunkedLocalAttentionSpec, "
                f"got {kv_cache_spec}"
            )
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        alignment_tokens: int,
    ) -> tuple[list[KVCacheBlock], ...]:
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        if use_eagle:
            raise ValueError("chunked local attention does not support EAGLE")
        block_size = kv_cache_spec.block_size
        chunk = kv_cache_spec.attention_chunk_size
        local_start_block = max_length // chunk * chunk // block_size
        max_num_blocks = max_length // block_size
        null = block_pool.null_block
        computed = tuple([null] * local_start_block for _ in kv_cache_group_ids)
        for i in range(local_start_block, min(max_num_blocks, len(block_hashes))):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                break
            for lst, blk in zip(computed, cached, strict=True):
                lst.append(blk)
        return computed

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        self.get_blocks(running_request_id)
        return 0
