"""FreeKVCacheBlockQueue and KVCacheBlock: orders, O(1) removal, misuse."""

from __future__ import annotations

import pytest

from paged.kvcache import (
    BlockStateError,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    NotEnoughBlocksError,
    make_block_hash_with_group_id,
)
from paged.kvcache.ids import BlockHash


def ids(q: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in q.get_all_free_blocks()]


def make(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def test_initial_order_and_popleft() -> None:
    blocks, q = make(5)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    assert q.popleft() is blocks[0]
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    assert [b.block_id for b in q.popleft_n(3)] == [1, 2, 3]
    assert ids(q) == [4] and q.num_free_blocks == 1
    assert q.popleft_n(0) == []


def test_remove_middle_append_prepend() -> None:
    blocks, q = make(6)
    q.remove(blocks[2])
    q.remove(blocks[5])
    assert ids(q) == [0, 1, 3, 4]
    q.append(blocks[2])
    assert ids(q) == [0, 1, 3, 4, 2]
    q.remove(blocks[0])
    q.remove(blocks[4])
    q.append_n([blocks[4], blocks[0]])
    assert ids(q) == [1, 3, 2, 4, 0]
    q.prepend_n([blocks[5]])
    assert ids(q) == [5, 1, 3, 2, 4, 0]
    q.remove(blocks[3])
    q.remove(blocks[2])
    q.prepend_n([blocks[3], blocks[2]])
    assert ids(q) == [3, 2, 5, 1, 4, 0] and len(q) == 6


def test_empty_queue_operations() -> None:
    blocks, q = make(2)
    q.popleft_n(2)
    assert ids(q) == [] and len(q) == 0
    with pytest.raises(NotEnoughBlocksError):
        q.popleft()
    q.append_n([])
    q.prepend_n([blocks[1]])
    q.append(blocks[0])
    assert ids(q) == [1, 0]


def test_misuse_raises_and_keeps_queue_intact() -> None:
    blocks, q = make(4)
    with pytest.raises(NotEnoughBlocksError):
        q.popleft_n(5)
    with pytest.raises(ValueError, match="n must be"):
        q.popleft_n(-1)
    with pytest.raises(BlockStateError):
        q.append(blocks[1])  # already in the queue
    with pytest.raises(BlockStateError):
        q.append_n([blocks[1]])
    q.remove(blocks[3])
    with pytest.raises(BlockStateError):
        q.remove(blocks[3])  # not in the queue
    with pytest.raises(BlockStateError):
        q.append_n([blocks[3], blocks[0]])  # second is queued already
    assert ids(q) == [0, 1, 2, 3] and len(q) == 4  # first one went in, queue consistent
    q.remove(blocks[3])
    with pytest.raises(BlockStateError):
        q.prepend_n([blocks[3], blocks[2]])
    assert ids(q) == [3, 0, 1, 2] and len(q) == 4


def test_block_hash_set_once() -> None:
    block = KVCacheBlock(7)
    key = make_block_hash_with_group_id(BlockHash(b"h"), 0)
    block.block_hash = key
    with pytest.raises(BlockStateError):
        block.block_hash = key
    block.reset_hash()
    assert block.block_hash is None
    block.block_hash = key
    assert block.block_hash == key
    assert "block_id=7" in repr(block)
    assert KVCacheBlock(1) != KVCacheBlock(1)  # identity equality
