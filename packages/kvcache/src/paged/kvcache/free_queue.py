"""`FreeKVCacheBlockQueue`: the LRU eviction order of free blocks.

An intrusive doubly-linked list threaded through `KVCacheBlock.prev_free_block`
and `next_free_block`, with two sentinel blocks so that no operation branches
on an empty neighbour:

    fake_head <-> b_first <-> ... <-> b_last <-> fake_tail

Order invariant: the front holds the block to hand out (and evict) next, the
back the block to keep longest. A block is in the queue iff both its links are
set. `collections.deque` cannot remove from the middle in O(1), which `touch()`
needs when a cache hit revives a free block; this list does every operation in
O(1) (O(n) for the `_n` variants) without allocating any node objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.errors import BlockStateError, NotEnoughBlocksError


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (front = evicted first)."""

    __slots__ = ("fake_free_list_head", "fake_free_list_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise BlockStateError(f"block {block.block_id} is already in a free queue")
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block."""
        if self.num_free_blocks == 0:
            raise NotEnoughBlocksError("No free blocks available")  # vLLM's message
        head = self.fake_free_list_head
        block = head.next_free_block
        assert block is not None and block.next_free_block is not None
        nxt = block.next_free_block
        head.next_free_block = nxt
        nxt.prev_free_block = head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks, front first."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.num_free_blocks:
            raise NotEnoughBlocksError(
                f"cannot pop {n} blocks: only {self.num_free_blocks} are free"
            )
        if n == 0:
            return []
        head = self.fake_free_list_head
        block = head.next_free_block
        ret: list[KVCacheBlock] = []
        append = ret.append
        for _ in range(n):
            assert block is not None
            append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return ret

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue in O(1)."""
        prev = block.prev_free_block
        nxt = block.next_free_block
        if prev is None or nxt is None:
            raise BlockStateError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the back (evicted last)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise BlockStateError(f"block {block.block_id} is already in the free queue")
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put `blocks` at the back, in order (the last one is evicted last)."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        assert last is not None
        count = 0
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                # Restore the tail link before reporting, so the queue stays valid.
                last.next_free_block = tail
                tail.prev_free_block = last
                self.num_free_blocks += count
                raise BlockStateError(f"block {block.block_id} is already in the free queue")
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += count

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put `blocks` at the front, in order (the first one is handed out first)."""
        head = self.fake_free_list_head
        first = head.next_free_block
        assert first is not None
        prev = head
        count = 0
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                prev.next_free_block = first
                first.prev_free_block = prev
                self.num_free_blocks += count
                raise BlockStateError(f"block {block.block_id} is already in the free queue")
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
            count += 1
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, front first (O(n); for tests and diagnostics)."""
        ret: list[KVCacheBlock] = []
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not None and block is not tail:
            ret.append(block)
            block = block.next_free_block
        return ret

    def __len__(self) -> int:
        return self.num_free_blocks
