"""Conformance with vLLM v1's block-level structures and single-type managers.

Blocks, the free queue, the hash-to-block index, `BlockPool` caching and
eviction, and the per-attention-type managers driven directly (as vLLM's
unit tests drive them, including with block objects that do not come from
the pool).
"""

from __future__ import annotations

import random

import pytest

from paged.kvcache import (
    BlockHash,
    BlockHashToBlockMap,
    BlockHashWithGroupId,
    BlockPool,
    ChunkedLocalAttentionManager,
    ChunkedLocalAttentionSpec,
    FreeKVCacheBlockQueue,
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SimpleRequest,
    SlidingWindowManager,
    SlidingWindowSpec,
    get_kv_cache_config,
    get_max_concurrency_for_kv_cache_config,
    get_request_block_hasher,
    make_block_hash_with_group_id,
    sha256,
)


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_kv_cache_block_hash_set_and_reset() -> None:
    block = KVCacheBlock(block_id=0)
    assert (block.block_id, block.ref_cnt, block.block_hash) == (0, 0, None)
    block.ref_cnt += 1
    block.ref_cnt -= 1
    key = make_block_hash_with_group_id(BlockHash(b"abc"), 0)
    block.block_hash = key
    assert block.block_hash == key
    block.reset_hash()
    assert block.block_hash is None


def test_free_queue_initialization_and_operations() -> None:
    block = KVCacheBlock(block_id=0)
    queue = FreeKVCacheBlockQueue([block])
    assert queue.num_free_blocks == 1
    assert queue.fake_free_list_head.next_free_block is block
    assert queue.fake_free_list_tail.prev_free_block is block

    blocks = [KVCacheBlock(block_id=i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.get_all_free_blocks() == blocks
    assert queue.popleft() is blocks[0]
    assert queue.get_all_free_blocks() == blocks[1:]
    queue.remove(blocks[2])
    assert queue.get_all_free_blocks() == [blocks[1], blocks[3], blocks[4]]
    queue.append(blocks[2])
    assert queue.get_all_free_blocks() == [blocks[1], blocks[3], blocks[4], blocks[2]]
    for _ in range(4):
        queue.popleft()
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError, match=r"^No free blocks available$"):
        queue.popleft()


def test_free_queue_append_n_prepend_n_popleft_n() -> None:
    queue = FreeKVCacheBlockQueue([])
    blocks = [KVCacheBlock(block_id=i) for i in range(6)]
    queue.append_n([])
    assert queue.num_free_blocks == 0
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    queue.append_n(blocks[0:1])
    queue.append_n(blocks[4:6])
    queue.append_n(blocks[1:4])
    assert ids(queue.get_all_free_blocks()) == [0, 4, 5, 1, 2, 3]
    assert queue.fake_free_list_tail.prev_free_block is blocks[3]

    # A broken tail link is an internal error, reported as an assertion.
    invalid = FreeKVCacheBlockQueue([])
    invalid.fake_free_list_tail.prev_free_block = None
    with pytest.raises(AssertionError):
        invalid.append_n([KVCacheBlock(block_id=9)])
    assert invalid.num_free_blocks == 0

    queue = FreeKVCacheBlockQueue([])
    more = [KVCacheBlock(block_id=i) for i in range(6)]
    queue.prepend_n(more[0:2])
    queue.prepend_n(more[4:6])
    queue.append_n(more[2:4])
    assert ids(queue.get_all_free_blocks()) == [4, 5, 0, 1, 2, 3]

    order = [1, 3, 5, 4, 0, 2]
    blocks = [KVCacheBlock(block_id=i) for i in range(6)]
    queue = FreeKVCacheBlockQueue([blocks[i] for i in order])
    assert queue.popleft_n(0) == []
    assert ids(queue.popleft_n(1)) == [1]
    assert ids(queue.popleft_n(2)) == [3, 5]
    assert queue.fake_free_list_head.next_free_block is blocks[4]
    assert ids(queue.popleft_n(3)) == [4, 0, 2]
    assert queue.num_free_blocks == 0
    assert all(b.prev_free_block is None and b.next_free_block is None for b in blocks)


def test_block_hash_to_block_map_single_and_multi() -> None:
    cache = BlockHashToBlockMap()
    k0, k1 = BlockHashWithGroupId(b"hash0"), BlockHashWithGroupId(b"hash1")
    b00, b01, b10, b11 = (KVCacheBlock(i) for i in (0, 1, 10, 11))
    assert cache.get_one_block(k0) is None
    cache.insert(k0, b00)
    assert cache.get_one_block(k0) is b00
    assert cache.pop(k0, 1) is None  # another id under the key: nothing popped
    assert cache.get_one_block(k0) is b00
    cache.insert(k0, b01)
    cache.insert(k1, b10)
    cache.insert(k1, b11)
    assert cache.pop(k0, 0) is b00
    assert cache.get_one_block(k0) is b01
    assert cache.pop(k0, 1) is b01
    assert cache.get_one_block(k0) is None and cache.pop(k0, 2) is None
    assert cache.get_one_block(k1) is b10
    assert cache.pop(k1, 10) is b10
    assert cache.get_one_block(k1) is b11
    assert cache.pop(k1, 11) is b11
    assert cache.pop(k1, 12) is None and len(cache) == 0


def test_maybe_evict_cached_block_keeps_other_blocks_under_the_key() -> None:
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
    h0 = make_block_hash_with_group_id(BlockHash(b"10"), 1000)
    h1 = make_block_hash_with_group_id(BlockHash(b"20"), 2000)
    h2 = make_block_hash_with_group_id(BlockHash(b"30"), 3000)
    for block, key in zip(pool.blocks, [h0, h1, h2, h2], strict=True):
        block.block_hash = key
        pool.cached_block_hash_to_block.insert(key, block)
    b0, b1, b2, b3 = pool.blocks
    cache = pool.cached_block_hash_to_block._cache
    assert cache == {h0: b0, h1: b1, h2: {2: b2, 3: b3}}
    pool._maybe_evict_cached_block(b1)
    assert cache == {h0: b0, h2: {2: b2, 3: b3}}
    pool._maybe_evict_cached_block(b2)
    assert cache == {h0: b0, h2: {3: b3}}
    pool._maybe_evict_cached_block(b3)
    assert cache == {h0: b0}
    pool._maybe_evict_cached_block(b0)
    assert cache == {}


def make_req(tokens: list[int], block_size: int = 4) -> SimpleRequest:
    return SimpleRequest("0", tokens, get_request_block_hasher(block_size, sha256))


def test_cache_full_blocks_single_and_multi_group() -> None:
    pool = BlockPool(num_gpu_blocks=5, enable_caching=True, hash_block_size=4)
    req = make_req(list(range(14)))  # blocks [0..4) [4..8) [8..12) [12, 13]
    blocks = [KVCacheBlock(block_id=i) for i in range(2)]
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    assert len(pool.cached_block_hash_to_block) == 2
    assert all(b.block_hash is not None for b in blocks)
    blocks += [KVCacheBlock(block_id=2)]
    pool.cache_full_blocks(req, blocks, 2, 3, 4, 0)
    assert len(pool.cached_block_hash_to_block) == 3

    pool = BlockPool(num_gpu_blocks=10, enable_caching=True, hash_block_size=4)
    group0 = [KVCacheBlock(block_id=i) for i in range(2)]
    pool.cache_full_blocks(req, group0, 0, 2, 4, 0)
    group1 = [KVCacheBlock(block_id=i) for i in range(3)]
    pool.cache_full_blocks(req, group1, 0, 3, 4, 1)
    assert len(pool.cached_block_hash_to_block) == 5 and len(req.block_hashes) == 3
    h = req.block_hashes
    assert pool.get_cached_block(h[0], kv_cache_group_ids=[0]) is not None
    assert pool.get_cached_block(h[1], kv_cache_group_ids=[0]) is not None
    assert pool.get_cached_block(h[2], kv_cache_group_ids=[0]) is None
    assert pool.get_cached_block(h[2], kv_cache_group_ids=[1]) is not None
    assert pool.get_cached_block(h[0], kv_cache_group_ids=[0, 1]) is not None
    assert pool.get_cached_block(h[1], kv_cache_group_ids=[0, 1]) is not None
    # All or nothing across groups.
    assert pool.get_cached_block(h[2], kv_cache_group_ids=[0, 1]) is None


def sliding_spec(block_size: int = 2, window: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=window
    )


def chunked_spec(block_size: int = 2, chunk: int = 4) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype="float32",
        attention_chunk_size=chunk,
    )


def mock_cached(pool: BlockPool, cached: list[bool]) -> list[BlockHash]:
    hashes = [BlockHash(str(i).encode()) for i in range(len(cached))]
    pool.cached_block_hash_to_block._cache.clear()
    for i, (h, is_cached) in enumerate(zip(hashes, cached, strict=True)):
        if is_cached:
            pool.cached_block_hash_to_block.insert(
                make_block_hash_with_group_id(h, 0), pool.blocks[i + 10]
            )
    return hashes


@pytest.mark.parametrize(
    ("cached", "expect"),
    [
        ([False] * 10, 0),
        ([True], 1),
        ([True, False], 1),
        ([True, True], 2),
        ([True, True, False], 2),
        ([True, True, True], 3),
        ([True, True, True, False], 3),
        ([True, True, False, True, False, False, True, True, False, True, True, True], 12),
        ([True, True, False, True, False, False, True, True, False, False, False], 8),
        ([True, True, False, True, False, False, True, True, False, False, False, True], 8),
    ],
)
def test_sliding_window_possible_cached_prefix(cached: list[bool], expect: int) -> None:
    spec = sliding_spec()
    pool = BlockPool(num_gpu_blocks=100, enable_caching=True, hash_block_size=2)
    SlidingWindowManager(spec, pool, True, 0)
    hashes = mock_cached(pool, cached)
    (computed,) = SlidingWindowManager.find_longest_cache_hit(
        block_hashes=hashes,
        max_length=len(hashes) * 2,
        kv_cache_group_ids=[0],
        block_pool=pool,
        kv_cache_spec=spec,
        use_eagle=False,
        alignment_tokens=2,
    )
    assert len(computed) == expect
    assert all(b is pool.null_block for b in computed[: expect - 2])
    for i in range(min(2, expect)):
        assert computed[expect - i - 1].block_id == expect - i - 1 + 10


@pytest.mark.parametrize(
    ("cached", "tail", "expect"),
    [
        ([True], 0, 1),
        ([True], 1, 1),
        ([True, False], 0, 2),
        ([True, False], 1, 2),
        ([True, True], 0, 2),
        ([True, True], 1, 2),
        ([True, True, False], 0, 2),
        ([True, True, False], 1, 2),
        ([True, True, True], 0, 3),
        ([True, True, True], 1, 3),
        ([True, True, True, False], 0, 4),
        ([True, True, True, False], 1, 4),
        ([None] * 8 + [True], 1, 9),
        ([None] * 8 + [False], 1, 8),
        ([None] * 8 + [True, True], 1, 10),
        ([None] * 8 + [True, False], 0, 10),
        ([None] * 8 + [True, False], 1, 10),
        ([None] * 8 + [False, True], 0, 10),
        ([None] * 8 + [False, True], 1, 10),
        ([None] * 8 + [False, False], 0, 10),
        ([None] * 8 + [False, False], 1, 10),
    ],
)
def test_chunked_local_possible_cached_prefix(
    cached: list[bool | None], tail: int, expect: int
) -> None:
    spec = chunked_spec()
    pool = BlockPool(num_gpu_blocks=100, enable_caching=True, hash_block_size=2)
    rng = random.Random(len(cached) * 10 + tail)
    flags = [rng.choice([True, False]) if c is None else c for c in cached]
    hashes = mock_cached(pool, flags)
    (computed,) = ChunkedLocalAttentionManager.find_longest_cache_hit(
        block_hashes=hashes,
        max_length=len(hashes) * 2 + tail,
        kv_cache_group_ids=[0],
        block_pool=pool,
        kv_cache_spec=spec,
        use_eagle=False,
        alignment_tokens=2,
    )
    assert len(computed) == expect
    assert all(b is pool.null_block for b in computed[: (expect - 1) // 2])


def foreign_table(pool: BlockPool, block_ids: list[int]) -> list[KVCacheBlock]:
    """Block objects that are not the pool's (as vLLM's unit tests build them)."""
    return [pool.null_block if i == 0 else KVCacheBlock(i) for i in block_ids]


def table_ids(table: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in table]


ORIGINAL = list(range(1000, 1011))


def test_sliding_window_remove_skipped_blocks() -> None:
    pool = BlockPool(num_gpu_blocks=2000, enable_caching=True, hash_block_size=2)
    mgr = SlidingWindowManager(sliding_spec(), pool, True, 0)
    table = foreign_table(pool, ORIGINAL)
    mgr.req_to_blocks["test"] = table
    mgr.remove_skipped_blocks("test", 0)
    assert table_ids(table) == ORIGINAL
    mgr.remove_skipped_blocks("test", 5)  # token 5 sees 2..5: block 0 left the window
    assert table_ids(table) == [0, *ORIGINAL[1:]]
    mgr.remove_skipped_blocks("test", 7)
    assert table_ids(table) == [0] * 2 + ORIGINAL[2:]
    mgr.remove_skipped_blocks("test", 13)
    assert table_ids(table) == [0] * 5 + ORIGINAL[5:]
    mgr.remove_skipped_blocks("test", 22)
    assert table_ids(table) == [0] * 9 + ORIGINAL[9:]


def test_sliding_window_frees_pool_blocks_to_the_front_when_uncached() -> None:
    pool = BlockPool(num_gpu_blocks=10, enable_caching=True, hash_block_size=2)
    mgr = SlidingWindowManager(sliding_spec(), pool, True, 0)
    mgr.req_to_blocks["r"] = pool.get_new_blocks(4)  # blocks 1..4
    mgr.remove_skipped_blocks("r", 7)  # tokens 0..3 skipped: blocks 1, 2
    assert table_ids(mgr.req_to_blocks["r"]) == [0, 0, 3, 4]
    # Collected right to left and put at the front in that order.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 1, 5, 6, 7, 8, 9]


def test_chunked_local_remove_skipped_blocks() -> None:
    pool = BlockPool(num_gpu_blocks=2000, enable_caching=True, hash_block_size=2)
    mgr = ChunkedLocalAttentionManager(chunked_spec(), pool, True, 0)
    table = foreign_table(pool, ORIGINAL)
    mgr.req_to_blocks["test"] = table
    mgr.remove_skipped_blocks("test", 0)
    assert table_ids(table) == ORIGINAL
    mgr.remove_skipped_blocks("test", 4)  # token 4 starts chunk 1: chunk 0 skipped
    assert table_ids(table) == [0] * 2 + ORIGINAL[2:]
    mgr.remove_skipped_blocks("test", 6)
    assert table_ids(table) == [0] * 2 + ORIGINAL[2:]
    mgr.remove_skipped_blocks("test", 12)
    assert table_ids(table) == [0] * 6 + ORIGINAL[6:]


def test_get_num_blocks_to_allocate_counts_evictable_hits() -> None:
    pool = BlockPool(num_gpu_blocks=100, enable_caching=True, hash_block_size=2)
    mgr = SlidingWindowManager(sliding_spec(), pool, True, 0)
    cached_1 = [KVCacheBlock(i + 1) for i in range(10)]
    cached_2 = [pool.null_block] * 5 + [KVCacheBlock(i + 1) for i in range(5)]
    assert mgr.get_num_blocks_to_allocate("1", 40, cached_1, 0, 40) == 20
    assert mgr.get_num_blocks_to_allocate("2", 40, cached_2, 0, 40) == 15


def test_evictable_hit_counts_in_capacity_but_is_not_allocated_twice() -> None:
    pool = BlockPool(num_gpu_blocks=100, enable_caching=True, hash_block_size=2)
    mgr = SlidingWindowManager(sliding_spec(), pool, True, 0)
    evictable = pool.blocks[1]  # free (ref_cnt 0): touching it takes a free block
    assert mgr.get_num_blocks_to_allocate("req", 4, [evictable], 2, 4) == 2
    mgr.allocate_new_computed_blocks("req", [evictable], 2, 0)
    new = mgr.allocate_new_blocks("req", 4, 4)
    assert len(new) == 1 and len(mgr.req_to_blocks["req"]) == 2
    assert evictable.ref_cnt == 1


def spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")


def test_get_kv_cache_config_uniform_and_hybrid() -> None:
    page = spec().page_size_bytes
    cfg = get_kv_cache_config({"layer_1": spec(), "layer_2": spec()}, page * 2 * 32)
    assert cfg == KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[
            KVCacheTensor(size=page * 32, shared_by=["layer_1"]),
            KVCacheTensor(size=page * 32, shared_by=["layer_2"]),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer_1", "layer_2"], spec())],
    )
    sw = sliding_spec(16, 32)
    assert sw.page_size_bytes == page
    cfg = get_kv_cache_config({"layer_1": spec(), "layer_2": sw}, page * 2 * 32)
    # One layer per group: one tensor shared by both groups' layer.
    assert cfg == KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[KVCacheTensor(size=page * 64, shared_by=["layer_1", "layer_2"])],
        kv_cache_groups=[KVCacheGroupSpec(["layer_1"], spec()), KVCacheGroupSpec(["layer_2"], sw)],
    )
    # 2 full + 4 sliding layers: groups of 2, three groups, tensors of 3 layers.
    layers = {"f0": spec(), "f1": spec(), "s0": sw, "s1": sw, "s2": sw, "s3": sw}
    cfg = get_kv_cache_config(layers, page * 2 * 10)
    groups = [g.layer_names for g in cfg.kv_cache_groups]
    assert groups == [["f0", "f1"], ["s0", "s1"], ["s2", "s3"]]
    assert [t.shared_by for t in cfg.kv_cache_tensors] == [["f0", "s0", "s2"], ["f1", "s1", "s3"]]
    assert cfg.num_blocks == 10
    cfg = get_kv_cache_config(layers, page * 2 * 10, num_gpu_blocks_override=7)
    assert cfg.num_blocks == 7 and cfg.kv_cache_tensors[0].size == page * 7


def test_max_concurrency_for_kv_cache_config() -> None:
    full_spec = FullAttentionSpec(block_size=16, num_kv_heads=32, head_size=128, dtype="float16")
    sw_spec = SlidingWindowSpec(
        block_size=16, num_kv_heads=32, head_size=128, dtype="float16", sliding_window=1024
    )
    first = [f"layer_{i}" for i in range(32)]
    second = [f"layer_{i}" for i in range(32, 64)]

    def cfg(num_blocks: int, *groups: KVCacheGroupSpec) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[*groups])

    full_only = cfg(int(1024 * 1.5), KVCacheGroupSpec(first, full_spec))
    assert get_max_concurrency_for_kv_cache_config(full_only, 16384, 1024) == 1.5
    # The window (1023) plus one step (1024) rounds to 128 blocks, plus one.
    sw_only = cfg(129 * 3, KVCacheGroupSpec(first, sw_spec))
    assert get_max_concurrency_for_kv_cache_config(sw_only, 16384, 1024) == 3
    hybrid = cfg(
        (1024 + 129) * 3, KVCacheGroupSpec(first, full_spec), KVCacheGroupSpec(second, sw_spec)
    )
    assert get_max_concurrency_for_kv_cache_config(hybrid, 16384, 1024) == 3
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=32, head_size=128, dtype="float16", attention_chunk_size=512
    )
    # The chunk (512) plus one step (1024): 96 blocks.
    assert chunked.max_memory_usage_bytes(16384, 1024) == 96 * chunked.page_size_bytes
