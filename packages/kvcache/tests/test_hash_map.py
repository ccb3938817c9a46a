"""BlockHashToBlockMap: single entry promoted to a dict, no de-duplication."""

from __future__ import annotations

from paged.kvcache import BlockHashToBlockMap, KVCacheBlock, make_block_hash_with_group_id
from paged.kvcache.ids import BlockHash, get_block_hash, get_group_id


def test_insert_promote_pop() -> None:
    m = BlockHashToBlockMap()
    key = make_block_hash_with_group_id(BlockHash(b"abc"), 3)
    assert get_block_hash(key) == b"abc" and get_group_id(key) == 3
    b1, b2, b3 = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    assert m.get_one_block(key) is None
    m.insert(key, b1)
    assert m.get_one_block(key) is b1
    m.insert(key, b2)  # same hash, second block: both kept
    assert len(m) == 1 and m.num_blocks() == 2
    assert m.get_one_block(key) in (b1, b2)
    assert m.pop(key, 3) is None
    assert m.pop(key, 1) is b1
    assert m.get_one_block(key) is b2
    assert m.pop(key, 2) is b2
    assert len(m) == 0 and m.get_one_block(key) is None
    m.insert(key, b3)
    assert m.pop(key, 1) is None and m.get_one_block(key) is b3
    assert sorted(b.block_id for _, b in m.items()) == [3]


def test_group_ids_are_separate_keys() -> None:
    m = BlockHashToBlockMap()
    h = BlockHash(b"x" * 32)
    m.insert(make_block_hash_with_group_id(h, 0), KVCacheBlock(1))
    assert m.get_one_block(make_block_hash_with_group_id(h, 1)) is None
    assert make_block_hash_with_group_id(h, 1000)[-4:] == (1000).to_bytes(4, "big")
