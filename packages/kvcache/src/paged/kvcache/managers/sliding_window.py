"""`SlidingWindowManager`: each token attends to the last `sliding_window` tokens."""

from __future__ import annotations

from collections.abc import Sequence

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.block_pool import BlockPool
from paged.kvcache.ids import BlockHash
from paged.kvcache.managers.base import SingleTypeKVCacheManager
from paged.kvcache.specs import KVCacheSpec, SlidingWindowSpec, cdiv


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Frees blocks that left the window; looks up hits right to left.

    With `sliding_window = 4` and 7 computed tokens, the next token (7) sees
    tokens 4..7, so tokens 0..3 are skipped:

        tokens  0 1 2 3 | 4 5 6 | 7
                skipped | window  ^ next
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
    ) -> None:
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise ValueError(f"SlidingWindowManager needs a SlidingWindowSpec, got {kv_cache_spec}")
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

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
        """Rightmost run of hits long enough to cover a window; null blocks before it.

        The next token needs the `sliding_window - 1` tokens before it, i.e.
        `cdiv(sliding_window - 1, block_size)` contiguous blocks ending at the
        hit boundary. Scanning right to left finds the longest such hit first.
        A run starting at block 0 is valid even when shorter.
        """
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        contiguous_needed = cdiv(kv_cache_spec.sliding_window - 1, block_size)
        if use_eagle:
            contiguous_needed += 1
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        null = block_pool.null_block
        computed = tuple([null] * max_num_blocks for _ in kv_cache_group_ids)
        num_contiguous = 0
        match_found = False
        for i in range(max_num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                num_contiguous = 0
                continue
            if (
                num_contiguous == 0
                and block_size != alignment_tokens
                and (i + 1) * block_size % alignment_tokens != 0
            ):
                continue  # a hit must end on an alignment boundary
            for lst, blk in zip(computed, cached, strict=True):
                lst[i] = blk
            num_contiguous += 1
            if num_contiguous >= contiguous_needed:
                # e.g. [NULL, NULL, 8, 3, NULL, 9] -> [NULL, NULL, 8, 3] for 2 needed
                for lst in computed:
                    del lst[i + num_contiguous :]
                match_found = True
                break
        if not match_found:
            # Only a run starting at block 0 remains valid.
            for lst in computed:
                del lst[num_contiguous:]
            while (
                block_size != alignment_tokens
                and len(computed[0]) * block_size % alignment_tokens != 0
            ):
                for lst in computed:
                    lst.pop()
        if use_eagle and computed[0]:
            for lst in computed:
                lst.pop()
        return computed

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        # Prefix blocks are replaced by null blocks: nothing to share for cascade attention.
        self.get_blocks(running_request_id)
        return 0
