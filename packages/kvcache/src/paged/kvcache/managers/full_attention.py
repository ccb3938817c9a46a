"""`FullAttentionManager`: causal attention over every previous token (also MLA)."""

from __future__ import annotations

from collections.abc import Sequence

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.block_pool import BlockPool
from paged.kvcache.ids import BlockHash, group_id_suffix
from paged.kvcache.managers.base import SingleTypeKVCacheManager
from paged.kvcache.specs import KVCacheSpec


class FullAttentionManager(SingleTypeKVCacheManager):
    """Keeps every block; prefix hits are downward closed.

    Downward closed: if blocks 0..n hit, so do 0..n-1 (the hash chain), so a
    left-to-right scan stopping at the first miss finds the longest hit.
    """

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
        computed: tuple[list[KVCacheBlock], ...]
        if len(kv_cache_group_ids) == 1:
            # One group (the common case): probe the index directly.
            suffix = group_id_suffix(kv_cache_group_ids[0])
            # Probe the index's dict directly: this loop runs once per prompt block.
            get = block_pool.cached_block_hash_to_block.raw_get
            hits: list[KVCacheBlock] = []
            for i in range(max_num_blocks):
                entry = get(block_hashes[i] + suffix)
                if entry is None:
                    break
                hits.append(
                    entry if type(entry) is KVCacheBlock else next(iter(entry.values()))  # type: ignore[union-attr]
                )
            computed = (hits,)
        else:
            computed = tuple([] for _ in kv_cache_group_ids)
            for i in range(max_num_blocks):
                cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
                if cached is None:
                    break
                for lst, blk in zip(computed, cached, strict=True):
                    lst.append(blk)
        if use_eagle and computed[0]:
            # EAGLE needs the last hit block's hidden states: recompute it.
            for lst in computed:
                lst.pop()
        while block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens:
            for lst in computed:
                lst.pop()
        return computed

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        blocks = self.get_blocks(running_request_id)
        num_requests = len(self.req_to_blocks)
        num_common = 0
        for block in blocks:
            # ref_cnt == number of live requests: every request holds this block.
            if block.ref_cnt != num_requests:
                break
            num_common += 1
        return num_common
