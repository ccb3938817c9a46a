"""`MambaManager`: state-space layers keep only the latest state."""

from __future__ import annotations

from collections.abc import Sequence

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.block_pool import BlockPool
from paged.kvcache.ids import BlockHash
from paged.kvcache.managers.base import SingleTypeKVCacheManager
from paged.kvcache.specs import KVCacheSpec, MambaSpec


class MambaManager(SingleTypeKVCacheManager):
    """A block holds the recurrent state after its last token.

    The state is cumulative, so only the block holding the state at the last
    computed token is needed: every earlier block is skipped (freed, replaced
    by the null block). A cached block's state summarises its whole prefix, so
    one hit, the rightmost, is enough.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
    ) -> None:
        if not isinstance(kv_cache_spec, MambaSpec):
            raise ValueError(f"MambaManager needs a MambaSpec, got {kv_cache_spec}")
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)

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
        block_size = kv_cache_spec.block_size
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for i in range(max_num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                continue
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens != 0:
                continue
            for lst, blk in zip(computed, cached, strict=True):
                # Hit length is len(blocks) * block_size: pad the prefix with nulls.
                lst.extend([block_pool.null_block] * i)
                lst.append(blk)
            break
        return computed

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        self.get_blocks(running_request_id)
        return 0
