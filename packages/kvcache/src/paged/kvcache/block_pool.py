"""`BlockPool`: every physical block, the free queue and the prefix-cache index.

Invariants (checked by `check_integrity()`):
- block 0 is the null block: never in the free queue, never handed out, never
  hashed, its ref_cnt untouched by `touch` / `free_blocks`;
- every other block is either free (in the queue, ref_cnt 0), referenced
  (ref_cnt > 0, not in the queue) or reserved (see `reserve_blocks`);
- a block has a hash iff the index maps that hash to it.

Free-queue order (vLLM v1 compatible): blocks handed out come from the front.
`free_blocks` puts a block that holds no cached data at the *front* (its KV is
worthless, reuse it first) and a cached block at the *back*, in the order
given; managers free a request's blocks tail first, so a prefix outlives the
blocks that extend it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.errors import BlockStateError, KVCacheIntegrityError, NotEnoughBlocksError
from paged.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from paged.kvcache.free_queue import FreeKVCacheBlockQueue
from paged.kvcache.hash_map import BlockHashToBlockMap
from paged.kvcache.hashing import (
    BlockHashListWithBlockSize,
    generate_block_hash_extra_keys,
    need_extra_keys,
    published_extra_keys,
)
from paged.kvcache.ids import (
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    group_id_suffix,
)
from paged.kvcache.metrics import KVCacheMetricsCollector
from paged.kvcache.protocols import HashableRequest

logger = logging.getLogger(__name__)


class BlockPool:
    """Allocates, frees, caches and evicts blocks; O(1) per block everywhere."""

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int = 16,
        enable_kv_cache_events: bool = False,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(
                f"num_gpu_blocks must be >= 1 (block 0 is the null block), got {num_gpu_blocks}"
            )
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(idx) for idx in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Block 0 stands for "no block" in block tables (skipped sliding-window
        # positions, padding); it is popped once and never returned.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        self.metrics_collector = metrics_collector
        self.num_reserved_blocks = 0

    # ------------------------------------------------------------------ lookup
    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for `block_hash`, or None unless all groups hit."""
        get = self.cached_block_hash_to_block.get_one_block
        blocks: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            block = get(BlockHashWithGroupId(block_hash + group_id_suffix(group_id)))
            if block is None:
                return None
            blocks.append(block)
        return blocks

    # ----------------------------------------------------------------- caching
    def cache_full_blocks(
        self,
        request: HashableRequest,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Register `blocks[num_cached_blocks:num_full_blocks]` in the prefix cache.

        Uses `request.block_hashes` (adapted when `block_size` is a multiple of
        the hash block size). Null blocks are skipped. Emits one `BlockStored`.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        if num_full_blocks > len(blocks):
            raise ValueError(
                f"num_full_blocks ({num_full_blocks}) exceeds the {len(blocks)} blocks given"
            )
        if block_size == self.hash_block_size:
            block_hashes: Sequence[BlockHash] = request.block_hashes
        else:
            block_hashes = BlockHashListWithBlockSize(
                request.block_hashes, self.hash_block_size, block_size
            )
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"request has {len(block_hashes)} block hashes at block size {block_size}, "
                f"but {num_full_blocks} full blocks are to be cached; extend "
                "request.block_hashes with the request block hasher first"
            )
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        # Validate first: leave the pool intact on error. The ref count is not
        # checked (vLLM caches whatever block it is given).
        for blk in new_full_blocks:
            if not blk.is_null and blk._block_hash is not None:
                raise BlockStateError(f"cannot cache block {blk.block_id}: it is already cached")
        if len(new_full_blocks) > 1:
            real = [id(b) for b in new_full_blocks if not b.is_null]
            if len(set(real)) != len(real):
                raise BlockStateError("cannot cache one block at two positions")
        suffix = group_id_suffix(kv_cache_group_id)
        insert = self.cached_block_hash_to_block.insert
        events = self.enable_kv_cache_events
        new_hashes: list[BlockHash] = []
        i = num_cached_blocks
        for blk in new_full_blocks:
            if not blk.is_null:
                block_hash = block_hashes[i]
                key = BlockHashWithGroupId(block_hash + suffix)
                blk._block_hash = key
                insert(key, blk)
                if events:
                    new_hashes.append(block_hash)
            i += 1
        if events:
            self._emit_block_stored(
                request,
                new_full_blocks,
                block_hashes,
                new_hashes,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
            )

    def _emit_block_stored(
        self,
        request: HashableRequest,
        new_full_blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        new_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
        self.kv_event_queue.append(
            BlockStored(
                block_hashes=new_hashes,
                parent_block_hash=parent,
                token_ids=list(
                    request.all_token_ids[
                        num_cached_blocks * block_size : num_full_blocks * block_size
                    ]
                ),
                block_size=block_size,
                lora_name=request.lora_name,
                extra_keys=self._stored_extra_keys(
                    request, new_full_blocks, num_cached_blocks, block_size
                ),
                group_idx=kv_cache_group_id,
            )
        )

    @staticmethod
    def _stored_extra_keys(
        request: HashableRequest,
        new_full_blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        block_size: int,
    ) -> list[tuple[object, ...] | None] | None:
        """One entry per stored (non-null) block, parallel to `BlockStored.block_hashes`.

        Recomputed from the request rather than kept from hashing: only the
        event path pays for it. A request without extra keys gets one None per
        block, as vLLM publishes it; None when no block was stored.
        """
        keys: list[tuple[object, ...] | None] = []
        extra = need_extra_keys(request)
        mm_idx = 0
        start = num_cached_blocks * block_size
        for blk in new_full_blocks:
            if not blk.is_null:
                if extra:
                    tagged, mm_idx = generate_block_hash_extra_keys(
                        request, start, start + block_size, mm_idx
                    )
                    keys.append(published_extra_keys(tagged))
                else:
                    keys.append(None)
            start += block_size
        return keys or None

    # -------------------------------------------------------------- allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out `num_blocks` blocks from the front of the free queue (ref_cnt 1).

        A handed-out block that was still cached is evicted first (hash dropped,
        `BlockRemoved` emitted). Does not look up the prefix cache.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise NotEnoughBlocksError(
                f"cannot allocate {num_blocks} blocks: only "
                f"{self.free_block_queue.num_free_blocks} are free"
            )
        ret = self.free_block_queue.popleft_n(num_blocks)
        collector = self.metrics_collector
        for block in ret:
            if block._block_hash is not None:
                self._maybe_evict_cached_block(block)
            block.ref_cnt = 1  # free blocks always have ref_cnt 0
            if collector is not None:
                collector.on_block_evicted(block)
                collector.on_block_allocated(block)
        return ret

    def reserve_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks out of circulation for good (attention-sink blocks).

        Reserved blocks hold ref_cnt 1, are never freed, and count neither as
        capacity in `get_usage()` nor as "in use" for `reset_prefix_cache()`.
        """
        blocks = self.get_new_blocks(num_blocks)
        self.num_reserved_blocks += num_blocks
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop `block`'s hash from the index; True if it was cached."""
        block_hash = block._block_hash
        if block_hash is None:
            return False
        if self.cached_block_hash_to_block.pop(block_hash, block.block_id) is None:
            return False
        block._block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=[get_block_hash(block_hash)], group_idx=get_group_id(block_hash)
                )
            )
        return True

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving free ones from the queue.

        As in vLLM, any free block may be touched (it leaves the queue with
        ref_cnt 1), cached or not; null blocks are skipped.
        """
        remove = self.free_block_queue.remove
        collector = self.metrics_collector
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1
            if collector is not None:
                collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 go back to the queue.

        Cached blocks are appended at the back in the given order, uncached ones
        put at the front in the given order. Null blocks are ignored. Raises
        `BlockStateError` (pool unchanged) on a block of this pool with no
        reference left (a double free). Block objects that are not this pool's
        (test doubles, as vLLM's unit tests use) are decremented unchecked, as
        vLLM does, and queued only if they reach 0.
        """
        blocks = (
            ordered_blocks if isinstance(ordered_blocks, list | tuple) else list(ordered_blocks)
        )
        tail_blocks: list[KVCacheBlock] = []
        front_blocks: list[KVCacheBlock] | None = None
        for i, block in enumerate(blocks):
            if block.is_null:
                continue
            ref_cnt = block.ref_cnt - 1
            if ref_cnt < 0 and self._owns(block):
                for undo in blocks[:i]:  # nothing was queued yet: restoring counts suffices
                    if not undo.is_null:
                        undo.ref_cnt += 1
                raise BlockStateError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                if block._block_hash is not None:
                    tail_blocks.append(block)
                elif front_blocks is None:
                    front_blocks = [block]
                else:
                    front_blocks.append(block)
        if tail_blocks:
            self.free_block_queue.append_n(tail_blocks)
        if front_blocks is not None:
            self.free_block_queue.prepend_n(front_blocks)

    def _owns(self, block: KVCacheBlock) -> bool:
        block_id = block.block_id
        return 0 <= block_id < self.num_gpu_blocks and self.blocks[block_id] is block

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cached hashes of `block_ids` (e.g. a connector lost their data).

        Blocks stay where they are (in use or in the queue); only the index
        forgets them. Unknown ids raise `ValueError` before anything changes.
        """
        ids = list(block_ids)
        for block_id in ids:
            if not 0 <= block_id < self.num_gpu_blocks:
                raise ValueError(
                    f"block_ids contains {block_id}, outside [0, {self.num_gpu_blocks})"
                )
        for block_id in ids:
            self._maybe_evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use.

        Returns False (and changes nothing) while any request holds blocks.
        """
        num_used_blocks = (
            self.num_gpu_blocks - self.get_num_free_blocks() - self.num_reserved_blocks
        )
        if num_used_blocks != 1:  # the null block
            logger.warning(
                "Failed to reset prefix cache: %d blocks are still in use", num_used_blocks - 1
            )
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block._block_hash = None
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # ------------------------------------------------------------------ status
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (null and reserved excluded) not free."""
        total = self.num_gpu_blocks - 1 - self.num_reserved_blocks
        if total <= 0:
            return 0.0
        return 1.0 - (self.get_num_free_blocks() / total)

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the pending events (swap, no copy)."""
        events = self.kv_event_queue
        self.kv_event_queue = []
        return events

    def check_integrity(self) -> None:
        """Raise `KVCacheIntegrityError` if any pool invariant is broken (O(n))."""
        free = self._check_free_queue()
        null = self.null_block
        if not null.is_null or null is not self.blocks[0]:
            raise KVCacheIntegrityError("block 0 must be the null block")
        if null._block_hash is not None:
            raise KVCacheIntegrityError("the null block must never be hashed")
        referenced = 0
        for block in self.blocks:
            if block.ref_cnt < 0:
                raise KVCacheIntegrityError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if block.is_null and block is not null:
                raise KVCacheIntegrityError(f"block {block.block_id} is marked null")
            if block is null or id(block) in free:
                continue
            if block.ref_cnt == 0:
                raise KVCacheIntegrityError(
                    f"block {block.block_id} has ref_cnt 0 but is not in the free queue"
                )
            referenced += 1
        if len(free) + referenced + 1 != self.num_gpu_blocks:
            raise KVCacheIntegrityError(
                f"free ({len(free)}) + referenced ({referenced}) + null (1) "
                f"!= total ({self.num_gpu_blocks})"
            )
        if referenced < self.num_reserved_blocks:
            raise KVCacheIntegrityError("fewer referenced blocks than reserved blocks")
        self._check_hash_index()

    def _check_free_queue(self) -> set[int]:
        queue = self.free_block_queue
        seen: set[int] = set()
        prev = queue.fake_free_list_head
        block = prev.next_free_block
        while block is not queue.fake_free_list_tail:
            if block is None or block.prev_free_block is not prev:
                raise KVCacheIntegrityError("free queue links are inconsistent")
            if id(block) in seen or len(seen) > self.num_gpu_blocks:
                raise KVCacheIntegrityError(f"free queue contains block {block.block_id} twice")
            if block.is_null:
                raise KVCacheIntegrityError("the null block is in the free queue")
            if block.ref_cnt != 0:
                raise KVCacheIntegrityError(
                    f"free block {block.block_id} is referenced (ref_cnt {block.ref_cnt})"
                )
            if self.blocks[block.block_id] is not block:
                raise KVCacheIntegrityError(f"free queue holds a foreign block {block.block_id}")
            seen.add(id(block))
            prev, block = block, block.next_free_block
        if queue.fake_free_list_tail.prev_free_block is not prev:
            raise KVCacheIntegrityError("free queue tail link is inconsistent")
        if len(seen) != queue.num_free_blocks:
            raise KVCacheIntegrityError(
                f"free queue holds {len(seen)} blocks but counts {queue.num_free_blocks}"
            )
        for blk in self.blocks:
            linked = blk.prev_free_block is not None or blk.next_free_block is not None
            if linked != (id(blk) in seen):
                raise KVCacheIntegrityError(f"block {blk.block_id} has stale free-queue links")
        return seen

    def _check_hash_index(self) -> None:
        indexed: set[int] = set()
        for key, block in self.cached_block_hash_to_block.items():
            if block._block_hash != key:
                raise KVCacheIntegrityError(
                    f"index maps a hash to block {block.block_id}, whose hash differs"
                )
            if block.block_id in indexed:
                raise KVCacheIntegrityError(f"block {block.block_id} is indexed twice")
            indexed.add(block.block_id)
        for block in self.blocks:
            if (block._block_hash is not None) != (block.block_id in indexed):
                raise KVCacheIntegrityError(f"block {block.block_id}'s hash and the index disagree")
