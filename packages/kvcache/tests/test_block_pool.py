"""BlockPool: null block, allocation, caching, touch, free order, eviction, integrity."""

from __future__ import annotations

import pytest

from paged.kvcache import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStateError,
    BlockStored,
    KVCacheIntegrityError,
    NotEnoughBlocksError,
    SimpleRequest,
    get_request_block_hasher,
    sha256,
)
from paged.kvcache.ids import BlockHashWithGroupId

BS = 4


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def req(tokens: range | list[int], rid: str = "r") -> SimpleRequest:
    return SimpleRequest(rid, tokens, get_request_block_hasher(BS, sha256))


def test_null_block() -> None:
    pool = BlockPool(5, enable_caching=True, hash_block_size=BS)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_usage() == 0.0
    assert [b.block_id for b in pool.get_new_blocks(4)] == [1, 2, 3, 4]
    assert pool.get_usage() == 1.0
    with pytest.raises(NotEnoughBlocksError, match="only 0 are free"):
        pool.get_new_blocks(1)
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0  # untouched
    pool.check_integrity()


def test_cache_full_blocks_and_lookup() -> None:
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    r = req(range(10))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(r, blocks, 0, 2, BS, 0)
    assert blocks[0].block_hash is not None and blocks[2].block_hash is None
    assert pool.get_cached_block(r.block_hashes[1], [0]) == [blocks[1]]
    assert pool.get_cached_block(r.block_hashes[1], [0, 1]) is None  # all-or-nothing
    with pytest.raises(BlockStateError, match="already cached"):
        pool.cache_full_blocks(r, blocks, 1, 2, BS, 0)  # block 2 already cached
    with pytest.raises(ValueError, match="block hashes"):
        pool.cache_full_blocks(r, blocks, 2, 3, BS, 0)  # block 3 is not full
    pool.check_integrity()


def test_free_blocks_order() -> None:
    pool = BlockPool(8, enable_caching=True, hash_block_size=BS)
    r = req(range(12))
    blocks = pool.get_new_blocks(4)  # 1 2 3 4
    pool.cache_full_blocks(r, blocks, 0, 3, BS, 0)  # 1 2 3 cached, 4 not
    assert free_ids(pool) == [5, 6, 7]
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 5, 6, 7, 3, 2, 1]
    pool.check_integrity()


def test_touch_revives_free_blocks() -> None:
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    r = req(range(8))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(r, blocks, 0, 2, BS, 0)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 2, 1]
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1 and free_ids(pool) == [3, 4, 5, 1]
    # As in vLLM, a free uncached block may be touched too: it leaves the queue.
    pool.touch([blocks[0], pool.blocks[3], pool.null_block])
    assert blocks[0].ref_cnt == 1 and pool.blocks[3].ref_cnt == 1
    assert free_ids(pool) == [4, 5] and pool.null_block.ref_cnt == 0
    pool.check_integrity()


def test_double_free_raises_and_keeps_counts() -> None:
    pool = BlockPool(4, enable_caching=True, hash_block_size=BS)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(BlockStateError, match="freed more often"):
        pool.free_blocks([a, b, a])
    assert (a.ref_cnt, b.ref_cnt) == (1, 1) and free_ids(pool) == [3]
    pool.free_blocks([a])
    with pytest.raises(BlockStateError):
        pool.free_blocks([a])
    pool.check_integrity()


def test_eviction_on_reuse_and_events_order() -> None:
    pool = BlockPool(3, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    r = req(range(8))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(r, blocks, 0, 2, BS, 0)
    stored = pool.take_events()
    assert stored == [
        BlockStored(
            block_hashes=[r.block_hashes[0], r.block_hashes[1]],
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=BS,
            extra_keys=[None, None],
            group_idx=0,
        )
    ]
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 1]
    # Reusing both evicts them: one removed event per block, in eviction order.
    r2 = req(range(100, 104), "r2")
    new = pool.get_new_blocks(1)
    pool.cache_full_blocks(r2, new, 0, 1, BS, 0)
    events = pool.take_events()
    assert events[0] == BlockRemoved(block_hashes=[r.block_hashes[1]], group_idx=0)
    assert isinstance(events[1], BlockStored) and events[1].block_hashes == [r2.block_hashes[0]]
    assert pool.get_cached_block(r.block_hashes[1], [0]) is None
    assert pool.get_cached_block(r.block_hashes[0], [0]) == [blocks[0]]
    pool.check_integrity()


def test_evict_blocks_explicit() -> None:
    pool = BlockPool(4, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    r = req(range(8))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(r, blocks, 0, 2, BS, 0)
    pool.take_events()
    with pytest.raises(ValueError, match="outside"):
        pool.evict_blocks([1, 99])
    assert blocks[0].block_hash is not None  # validated before any change
    pool.evict_blocks({1, 3})
    assert blocks[0].block_hash is None and blocks[1].block_hash is not None
    assert pool.take_events() == [BlockRemoved(block_hashes=[r.block_hashes[0]], group_idx=0)]
    assert blocks[0].ref_cnt == 1  # still in use
    pool.check_integrity()


def test_reset_prefix_cache() -> None:
    pool = BlockPool(4, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    r = req(range(4))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(r, blocks, 0, 1, BS, 0)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert blocks[0].block_hash is None and len(pool.cached_block_hash_to_block) == 0
    assert pool.take_events() == [AllBlocksCleared()]
    pool.check_integrity()


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        BlockPool(0, enable_caching=True)
    with pytest.raises(ValueError, match="hash_block_size"):
        BlockPool(2, enable_caching=True, hash_block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(2, enable_caching=True).get_new_blocks(-1)


@pytest.mark.parametrize(
    "corrupt",
    ["negative", "free_referenced", "leaked", "hash_mismatch", "unindexed", "count"],
)
def test_check_integrity_detects(corrupt: str) -> None:
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    r = req(range(8))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(r, blocks, 0, 2, BS, 0)
    pool.check_integrity()
    if corrupt == "negative":
        blocks[0].ref_cnt = -1
    elif corrupt == "free_referenced":
        pool.blocks[5].ref_cnt = 1
    elif corrupt == "leaked":
        blocks[0].ref_cnt = 0  # neither free nor referenced
    elif corrupt == "hash_mismatch":
        blocks[0].reset_hash()
        blocks[0].block_hash = BlockHashWithGroupId(b"other")
    elif corrupt == "unindexed":
        pool.blocks[3].block_hash = BlockHashWithGroupId(b"orphan")
    else:
        pool.free_block_queue.num_free_blocks += 1
    with pytest.raises(KVCacheIntegrityError):
        pool.check_integrity()
