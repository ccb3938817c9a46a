"""`SingleTypeKVCacheManager`: per-request block lists of one KV cache group.

Block layout of one request in `req_to_blocks[request_id]` (index = block
position in the sequence):

    | null ... null | computed (cached) | computed (new) | new | lookahead |
    |<- skipped ->|<-- num_cached_block -->|

Skipped positions (outside a sliding window, before the current chunk, older
mamba states) hold the null block so that block position i always covers
tokens [i * block_size, (i + 1) * block_size).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.block_pool import BlockPool
from paged.kvcache.errors import UnknownRequestError
from paged.kvcache.ids import BlockHash
from paged.kvcache.protocols import KVCacheRequest
from paged.kvcache.specs import KVCacheSpec, cdiv


class SingleTypeKVCacheManager(ABC):
    """Allocation, caching and prefix lookup for one group of one attention type.

    State: `req_to_blocks` (blocks per live request, in position order) and
    `num_cached_block` (how many of those are registered in the prefix cache;
    a request is in it once it had a prefix hit or cached a full block, and
    then takes the fast path in `get_num_blocks_to_allocate`).
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    # ------------------------------------------------------------- capacity
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        """Free blocks that allocating slots for `num_tokens` tokens would consume.

        Counts new blocks plus prefix hits that currently sit in the free queue
        (touching them takes them out of it); hits on blocks in use cost nothing.
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        req_blocks = self.req_to_blocks.get(request_id)
        num_req_blocks = 0 if req_blocks is None else len(req_blocks)
        if request_id in self.num_cached_block:
            # A running request gets no new prefix hits. Speculative decoding may
            # have left more blocks than needed, hence the max.
            return max(num_required_blocks - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_computed_blocks = len(new_computed_blocks) + num_req_blocks
        # Skipped positions get the null block, computed ones their hit: only
        # positions beyond both need new blocks.
        num_new_blocks = max(
            num_required_blocks - max(num_skipped_blocks, num_local_computed_blocks), 0
        )
        # Hits inside the skipped range are dropped, not touched.
        first_kept = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable = 0
        for blk in new_computed_blocks[first_kept:]:
            if blk.ref_cnt == 0 and not blk.is_null:
                num_evictable += 1
        return num_new_blocks + num_evictable

    # ------------------------------------------------------------ allocation
    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Adopt prefix hits (and blocks for externally computed tokens) for a new request."""
        if request_id in self.num_cached_block:
            if new_computed_blocks:
                raise ValueError(
                    f"request {request_id!r} is running and cannot take new prefix hits"
                )
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        if req_blocks:
            raise ValueError(f"request {request_id!r} already holds blocks; hits must come first")
        num_total_computed = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total_computed)
        num_skipped_blocks = num_skipped_tokens // self.block_size
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
            num_external_computed_tokens = min(
                num_total_computed - num_skipped_tokens, num_external_computed_tokens
            )
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        elif any(not b.is_null for b in new_computed_blocks):
            raise ValueError("new_computed_blocks must be empty when prefix caching is disabled")
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        # Hits are cached already; remember so cache_blocks() does not re-hash them.
        self.num_cached_block[request_id] = len(req_blocks)
        if num_external_computed_tokens > 0:
            num_new = cdiv(num_total_computed, self.block_size) - len(req_blocks)
            if num_new > 0:
                req_blocks.extend(self.block_pool.get_new_blocks(num_new))

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Extend the request to cover `num_tokens` tokens; return only the new blocks."""
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Register the request's blocks that `num_tokens` tokens fill completely."""
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=self.req_to_blocks[request_id],
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=self.block_size,
            kv_cache_group_id=self.kv_cache_group_id,
        )
        self.num_cached_block[request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (a no-op for unknown ids).

        Tail first: the free queue then evicts a request's last blocks before
        its prefix, which other requests are more likely to share.
        """
        req_blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if req_blocks:
            req_blocks.reverse()  # the list is ours now: reverse in place, no copy
            self.block_pool.free_blocks(req_blocks)

    # ---------------------------------------------------------------- skipping
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV no later token attends to (0: keep everything)."""
        return 0

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free blocks that only hold skipped tokens, replacing them by the null block."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped_blocks = min(num_skipped_tokens // self.block_size, len(blocks))
        null = self._null_block
        removed: list[KVCacheBlock] = []
        # Walk back from the last skipped block: once a null is met, everything
        # before it was freed by an earlier call.
        for i in range(num_skipped_blocks - 1, -1, -1):
            blk = blocks[i]
            if blk is null:
                break
            removed.append(blk)
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def new_step_starts(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """A scheduling step begins (see `KVCacheManager.new_step_starts`); no-op here."""

    # ------------------------------------------------------------------ queries
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            raise UnknownRequestError(f"request_id {request_id!r} has no blocks in this manager")
        return blocks

    @abstractmethod
    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks of `running_request_id` shared by every live request."""

    @classmethod
    @abstractmethod
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
        """Longest usable prefix hit of at most `max_length` tokens, one list per group.

        `block_hashes` are at this spec's block size. The hit length in tokens
        is `len(result[0]) * block_size` (null blocks included).
        """
