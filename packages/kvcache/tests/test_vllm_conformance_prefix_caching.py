"""Conformance with vLLM v1's prefix-caching behaviour (KVCacheManager, one or more groups).

Each test replays a scenario that vLLM's own prefix-caching tests exercise and
asserts what vLLM observably does: exact block ids, free-queue order after
frees, eviction order, hit lengths, when blocks become cached, events. The
scenarios use vLLM's sizes (block size 16, small pools) so the ids can be
compared with vLLM's documented results one for one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from paged.kvcache import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    MambaSpec,
    SimpleRequest,
    SlidingWindowSpec,
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    hash_block_tokens,
    make_block_hash_with_group_id,
    sha256,
)
from paged.kvcache.hashing import get_none_hash

BS = 16


def full(block_size: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")


def sliding(window_blocks: int, block_size: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype="float32",
        sliding_window=window_blocks * block_size,
    )


def mamba(block_size: int = BS) -> MambaSpec:
    # These scenarios cache every full mamba block: vLLM's "all" mode.
    return MambaSpec(
        block_size=block_size, shapes=((1, 1),), dtypes=("float32",), mamba_cache_mode="all"
    )


def config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs or (full(),))]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def manager(num_blocks: int, *specs: KVCacheSpec, **kwargs: object) -> KVCacheManager:
    kwargs.setdefault("hash_block_size", BS)
    return KVCacheManager(config(num_blocks, *specs), 8192, **kwargs)  # type: ignore[arg-type]


def req(rid: str, tokens: Sequence[int], block_size: int = BS, **kwargs: object) -> SimpleRequest:
    return SimpleRequest(rid, tokens, get_request_block_hasher(block_size, sha256), **kwargs)  # type: ignore[arg-type]


def free_queue_ids(kvm: KVCacheManager) -> list[int]:
    return [b.block_id for b in kvm.block_pool.free_block_queue.get_all_free_blocks()]


def req_blocks(kvm: KVCacheManager, rid: str, group: int = 0) -> list[KVCacheBlock]:
    return kvm.coordinator.single_type_managers[group].req_to_blocks[rid]


COMMON = [i for i in range(3) for _ in range(BS)]  # three full blocks: 0*16, 1*16, 2*16


def test_prefill_ids_hashes_free_order_and_eviction() -> None:
    kvm = manager(11)
    tokens0 = COMMON + [3] * 7
    r0 = req("0", tokens0)
    hits, n = kvm.get_computed_blocks(r0)
    assert len(r0.block_hashes) == 3 and not hits.blocks[0] and n == 0
    new = kvm.allocate_slots(r0, 55, 0, hits)
    assert new is not None and new.get_block_ids() == ([1, 2, 3, 4],)
    # Full blocks carry the chained hash with group 0; the partial block none.
    parent: BlockHash | None = None
    for block_id in (1, 2, 3):
        expected = hash_block_tokens(sha256, parent, tokens0[(block_id - 1) * BS : block_id * BS])
        blk = kvm.block_pool.blocks[block_id]
        assert blk.block_hash is not None and blk.ref_cnt == 1
        assert get_block_hash(blk.block_hash) == expected and get_group_id(blk.block_hash) == 0
        parent = expected
    assert kvm.block_pool.blocks[4].block_hash is None

    # Hit while the blocks are in use: they are shared (ref_cnt 2).
    r1 = req("1", COMMON + [3] * 5)
    hits, n = kvm.get_computed_blocks(r1)
    assert hits.get_block_ids() == ([1, 2, 3],) and n == 48
    new = kvm.allocate_slots(r1, 5, 48, hits)
    assert new is not None and new.get_block_ids() == ([5],)
    assert [b.ref_cnt for b in hits.blocks[0]] == [2, 2, 2]
    assert kvm.block_pool.free_block_queue.num_free_blocks == 5

    kvm.free(r0)
    kvm.free(r1)
    assert kvm.block_pool.free_block_queue.num_free_blocks == 10
    # Uncached tails go to the front (last freed first), never-used blocks
    # next, the shared prefix last and tail-first.
    assert free_queue_ids(kvm) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # Hit while the blocks are free: the partial block 5 is reused first.
    r2 = req("2", COMMON + [3] * 6)
    hits, n = kvm.get_computed_blocks(r2)
    assert hits.get_block_ids() == ([1, 2, 3],) and n == 48
    new = kvm.allocate_slots(r2, 6, 48, hits)
    assert new is not None and new.get_block_ids() == ([5],)
    assert kvm.block_pool.free_block_queue.num_free_blocks == 6
    assert all(b.ref_cnt == 0 for b in kvm.block_pool.free_block_queue.get_all_free_blocks())
    kvm.free(r2)

    # A miss that takes every block: the ids come out in eviction order.
    r3 = req("3", [99] * (16 * 10))
    hits, n = kvm.get_computed_blocks(r3)
    assert n == 0
    new = kvm.allocate_slots(r3, 160, 0, hits)
    assert new is not None and new.get_block_ids() == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
    queue = kvm.block_pool.free_block_queue
    assert queue.num_free_blocks == 0
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head


def test_prompt_logprobs_request_skips_the_cache_and_duplicates_blocks() -> None:
    kvm = manager(11)
    r0 = req("0", COMMON + [3] * 7)
    kvm.allocate_slots(r0, 55)
    r1 = req("1", COMMON + [3] * 5)
    hits, n = kvm.get_computed_blocks(r1)
    kvm.allocate_slots(r1, 5, n, hits)
    kvm.free(r0)
    kvm.free(r1)
    r2 = req("2", COMMON + [3] * 6, skip_reading_prefix_cache=True)
    hits, n = kvm.get_computed_blocks(r2)
    assert n == 0 and not hits.blocks[0]
    new = kvm.allocate_slots(r2, 54, 0, hits)
    # Fresh blocks from the front of the queue; their full blocks are cached
    # again under the same hashes (no de-duplication), next to blocks 1..3.
    assert new is not None and new.get_block_ids() == ([5, 4, 6, 7],)
    dup = [kvm.block_pool.blocks[i].block_hash for i in (5, 4, 6)]
    orig = [kvm.block_pool.blocks[i].block_hash for i in (1, 2, 3)]
    assert dup == orig and None not in dup


def test_decode_appends_and_caches_the_block_the_new_tokens_fill() -> None:
    kvm = manager(11)
    r0 = req("0", COMMON + [3] * 7)
    hits, _ = kvm.get_computed_blocks(r0)
    new = kvm.allocate_slots(r0, 55, 0, hits)
    assert new is not None and new.get_block_ids() == ([1, 2, 3, 4],)
    r0.num_computed_tokens = 55
    for _ in range(4):
        r0.append_output_token_ids(8)
    new = kvm.allocate_slots(r0, 4, 0, hits)
    assert new is not None and len(new.blocks[0]) == 0
    assert req_blocks(kvm, "0")[-1].block_hash is None
    r0.num_computed_tokens = 59
    for _ in range(9 + 10):  # 9 fill block 4, 10 go to a new block
        r0.append_output_token_ids(7)
    new = kvm.allocate_slots(r0, 19, 0, hits)
    assert new is not None and len(new.blocks[0]) == 1
    assert req_blocks(kvm, "0")[-2].block_hash is not None
    assert req_blocks(kvm, "0")[-1].block_hash is None


def test_evict_order_after_two_requests_free() -> None:
    kvm = manager(11)
    last = 5 * 16 + 7
    r0 = req("0", list(range(last)))
    new = kvm.allocate_slots(r0, last)
    assert new is not None and len(new.blocks[0]) == 6
    r1 = req("1", list(range(last, last + 48)))
    new = kvm.allocate_slots(r1, 48)
    assert new is not None and len(new.blocks[0]) == 3
    assert kvm.block_pool.free_block_queue.num_free_blocks == 1
    kvm.free(r0)
    kvm.free(r1)
    assert free_queue_ids(kvm) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    r2 = req("2", list(range(2 * 16 + 3)))
    hits, n = kvm.get_computed_blocks(r2)
    assert hits.get_block_ids() == ([1, 2],) and n == 32
    new = kvm.allocate_slots(r2, 3, 32, hits)
    assert new is not None and new.get_block_ids() == ([6],)
    assert kvm.block_pool.free_block_queue.num_free_blocks == 7


def test_reused_block_loses_its_old_hash() -> None:
    kvm = manager(2)
    r0 = req("0", list(range(16)))
    new = kvm.allocate_slots(r0, 16)
    assert new is not None and len(new.blocks[0]) == 1
    kvm.free(r0)
    r1 = req("1", list(range(15)))
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 0
    new = kvm.allocate_slots(r1, 15, 0, hits)
    assert new is not None
    assert kvm.block_pool.blocks[new.blocks[0][0].block_id].block_hash is None


def test_hit_block_is_not_the_one_evicted() -> None:
    kvm = manager(3)
    r0 = req("0", list(range(16)))
    assert kvm.allocate_slots(r0, 16) is not None
    r1 = req("1", list(range(16, 32)))
    assert kvm.allocate_slots(r1, 16) is not None
    kvm.free(r0)
    kvm.free(r1)
    r2 = req("2", list(range(32)))
    hits, n = kvm.get_computed_blocks(r2)
    assert [b.block_id for b in hits.blocks[0]] == [1] and n == 16
    new = kvm.allocate_slots(r2, 16, 16, hits)
    assert new is not None and [b.block_id for b in new.blocks[0]] == [2]


def test_prefix_caching_disabled() -> None:
    kvm = manager(5, full(4), enable_caching=False, hash_block_size=4)
    r1 = req("1", list(range(10)), 4)
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 0 and not hits.blocks[0]
    new = kvm.allocate_slots(r1, 10, 0, hits)
    assert new is not None and len(new.blocks[0]) == 3
    kvm.free(r1)
    r2 = req("2", list(range(16)), 4)
    hits, n = kvm.get_computed_blocks(r2)
    assert n == 0 and not hits.blocks[0]
    new = kvm.allocate_slots(r2, 16, 0, hits)
    assert new is not None and len(new.blocks[0]) == 4
    r3 = req("3", list(range(4)), 4)
    hits, n = kvm.get_computed_blocks(r3)
    assert n == 0
    assert kvm.allocate_slots(r3, 4, 0, hits) is None
    assert all(b.block_hash is None for b in kvm.block_pool.blocks)


def test_hits_are_not_touched_when_allocation_fails() -> None:
    kvm = manager(11)
    r0 = req("0", COMMON)
    hits, n = kvm.get_computed_blocks(r0)
    kvm.allocate_slots(r0, 48, n, hits)
    part0 = req_blocks(kvm, "0")
    r1 = req("1", COMMON * 2)
    hits, n = kvm.get_computed_blocks(r1)
    assert list(hits.blocks[0]) == part0 and n == 48
    kvm.allocate_slots(r1, 48, n, hits)
    part1 = list(req_blocks(kvm, "1"))
    kvm.free(r1)
    assert {b.ref_cnt for b in part1[:3]} == {1} and {b.ref_cnt for b in part1[3:]} == {0}
    r2 = req("2", [7] * 32)
    hits, n = kvm.get_computed_blocks(r2)
    assert n == 0
    kvm.allocate_slots(r2, 32, 0, hits)
    assert kvm.block_pool.free_block_queue.num_free_blocks == 5
    r3 = req("3", COMMON * 3)
    hits, n = kvm.get_computed_blocks(r3)
    assert list(hits.blocks[0]) == part1 and n == 96
    # Three free hits (3..5) plus three new blocks: 6 > 5 free.
    assert kvm.allocate_slots(r3, 48, n, hits) is None
    assert {b.ref_cnt for b in part1[:3]} == {1} and {b.ref_cnt for b in part1[3:]} == {0}
    kvm.check_integrity()


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    kvm = manager(11)
    r0 = req("0", COMMON + [3] * 7)
    new = kvm.allocate_slots(r0, 55)
    assert new is not None and new.get_block_ids() == ([1, 2, 3, 4],)
    r1 = req("1", COMMON + [4] * 7)
    hits, n = kvm.get_computed_blocks(r1)
    assert len(r1.block_hashes) == 3 and len(hits.blocks[0]) == 3
    new = kvm.allocate_slots(r1, 7, n, hits)
    assert new is not None and new.get_block_ids() == ([5],)
    assert not kvm.reset_prefix_cache()
    assert kvm.block_pool.cached_block_hash_to_block
    kvm.free(r0)
    kvm.free(r1)
    assert kvm.reset_prefix_cache()
    assert not kvm.block_pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in kvm.block_pool.blocks)


def test_prefix_cache_stats_none_when_not_logging() -> None:
    kvm = manager(11, log_stats=False)
    assert kvm.prefix_cache_stats is None
    r = req("0", list(range(16)))
    hits, n = kvm.get_computed_blocks(r)
    kvm.allocate_slots(r, 16, n, hits)
    kvm.reset_prefix_cache()
    assert kvm.prefix_cache_stats is None and kvm.make_prefix_cache_stats() is None


@pytest.mark.parametrize("blocks_to_cache", [2, 3, 10])
def test_kv_cache_events(blocks_to_cache: int) -> None:
    kvm = manager(blocks_to_cache + 1, enable_kv_cache_events=True)
    num_tokens = BS * blocks_to_cache
    r0 = req("0", list(range(num_tokens)))
    kvm.allocate_slots(r0, num_tokens)
    events = kvm.take_events()
    stored = events[-1]
    assert isinstance(stored, BlockStored)
    assert len(stored.block_hashes) == blocks_to_cache
    assert len(kvm.block_pool.cached_block_hash_to_block) == blocks_to_cache
    assert len(stored.token_ids) == stored.block_size * len(stored.block_hashes)
    assert stored.parent_block_hash is None
    assert kvm.block_pool.kv_event_queue == []

    # Same tokens without a lookup: every cached block is evicted (one removed
    # event each), then one stored event for the new allocation.
    kvm.free(r0)
    r1 = req("1", list(range(num_tokens)))
    kvm.allocate_slots(r1, num_tokens)
    events = kvm.take_events()
    assert len(events) == blocks_to_cache + 1
    for ev in events[:-1]:
        assert isinstance(ev, BlockRemoved) and ev.block_hashes[0] in stored.block_hashes
    last = events[-1]
    assert isinstance(last, BlockStored) and len(last.block_hashes) == blocks_to_cache

    kvm.free(r1)
    assert kvm.reset_prefix_cache()
    events = kvm.take_events()
    assert isinstance(events[-1], AllBlocksCleared)
    assert len(kvm.block_pool.cached_block_hash_to_block) == 0


def test_hit_blocks_emit_no_second_stored_event() -> None:
    kvm = manager(11, enable_kv_cache_events=True)
    r0 = req("0", [*COMMON, 3])
    kvm.allocate_slots(r0, 49)
    first = kvm.take_events()
    assert [type(e) for e in first] == [BlockStored]
    r1 = req("1", COMMON + [4] * 20)
    hits, n = kvm.get_computed_blocks(r1)
    kvm.allocate_slots(r1, r1.num_tokens - n, n, hits)
    (ev,) = kvm.take_events()
    # Only block 3 of r1 (tokens 48..63) is new; its parent is the last hit.
    assert isinstance(ev, BlockStored) and len(ev.block_hashes) == 1
    assert ev.parent_block_hash == r1.block_hashes[2]
    assert ev.block_hashes == [r1.block_hashes[3]]


@dataclass(frozen=True)
class Placeholder:
    offset: int
    length: int


@dataclass(frozen=True)
class Feature:
    identifier: str
    mm_position: Placeholder


def features(positions: list[tuple[int, int]], ids: list[str]) -> list[Feature]:
    return [Feature(i, Placeholder(o, n)) for (o, n), i in zip(positions, ids, strict=True)]


def test_mm_prefix_caching_hashes_and_hits() -> None:
    # vLLM's keys and order; each part tagged by its source (as in vLLM 0.33).
    kvm = manager(11)
    # [T..T P0..P0] [P0..P0 T..T P1 P1] [P1 x16]
    common = list(range(10)) + [-1] * 6 + [-1] * 4 + list(range(10, 20)) + [-1] * 2 + [-1] * 16
    common_pos = [(11, 10), (30, 18)]
    tokens = common + [-1] * 7 + [100] * 4
    r0 = req("0", tokens, mm_features=features([*common_pos, (48, 7)], ["aaa", "bbb", "ccc"]))
    hits, n = kvm.get_computed_blocks(r0)
    assert n == 0 and not hits.blocks[0]
    h = r0.block_hashes
    assert len(h) == 3
    none = get_none_hash()
    assert h[0] == sha256((none, tuple(tokens[:16]), (("mm", "aaa", 11),)))
    assert h[1] == sha256((h[0], tuple(tokens[16:32]), (("mm", "aaa", -5), ("mm", "bbb", 14))))
    assert h[2] == sha256((h[1], tuple(tokens[32:48]), (("mm", "bbb", -2),)))
    new = kvm.allocate_slots(r0, 59, 0, hits)
    assert new is not None and new.get_block_ids() == ([1, 2, 3, 4],)
    r0.num_computed_tokens = 59
    for _ in range(5):
        r0.append_output_token_ids(8)
    new = kvm.allocate_slots(r0, 5, 0, hits)
    assert new is not None and len(new.blocks[0]) == 0
    assert len(h) == 4
    assert h[3] == sha256((h[2], tuple(tokens[48:] + [8] * 5), (("mm", "ccc", 0),)))

    tokens1 = common + [-1] * 7 + [200] * 5
    r1 = req("1", tokens1, mm_features=features([*common_pos, (48, 7)], ["aaa", "bbb", "ccc"]))
    hits, n = kvm.get_computed_blocks(r1)
    assert len(hits.blocks[0]) == 3 and n == 48
    # The same tokens with another image in block 1: only block 0 hits.
    r2 = req("2", tokens1, mm_features=features([*common_pos, (48, 7)], ["aaa", "zzz", "ccc"]))
    hits, n = kvm.get_computed_blocks(r2)
    assert n == 16


def test_cache_salt_in_block_zero_key_only() -> None:
    kvm = manager(11)
    tokens = COMMON + [3] * 11
    r0 = req("0", tokens, cache_salt="salt1")
    hits, n = kvm.get_computed_blocks(r0)
    assert n == 0
    h = r0.block_hashes
    none = get_none_hash()
    assert h[0] == sha256((none, tuple(tokens[:16]), (("cache_salt", "salt1"),)))
    assert h[1] == sha256((h[0], tuple(tokens[16:32]), None))
    assert h[2] == sha256((h[1], tuple(tokens[32:48]), None))
    new = kvm.allocate_slots(r0, 59, 0, hits)
    assert new is not None and new.get_block_ids() == ([1, 2, 3, 4],)
    r0.num_computed_tokens = 59
    for _ in range(5):
        r0.append_output_token_ids(8)
    kvm.allocate_slots(r0, 5)
    assert h[3] == sha256((h[2], tuple(tokens[48:] + [8] * 5), None))

    tokens1 = COMMON + [4] * 11
    hits, n = kvm.get_computed_blocks(req("1", tokens1, cache_salt="salt1"))
    assert len(hits.blocks[0]) == 3 and n == 48
    r2 = req("2", tokens1, cache_salt="salt2")
    hits, n = kvm.get_computed_blocks(r2)
    assert n == 0 and len(hits.blocks[0]) == 0
    assert r2.block_hashes[0] == sha256((none, tuple(tokens1[:16]), (("cache_salt", "salt2"),)))
    assert r2.block_hashes[1] == sha256((r2.block_hashes[0], tuple(tokens1[16:32]), None))


def test_lora_name_in_every_block_key() -> None:
    kvm = manager(11)
    tokens = [*COMMON, 3]
    r0 = req("0", tokens, lora_name="adapter")
    h = r0.block_hashes
    assert h[0] == sha256((get_none_hash(), tuple(tokens[:16]), (("lora", "adapter", None),)))
    assert h[1] == sha256((h[0], tuple(tokens[16:32]), (("lora", "adapter", None),)))
    kvm.allocate_slots(r0, 49)
    assert kvm.get_computed_blocks(req("1", tokens, lora_name="adapter"))[1] == 48
    assert kvm.get_computed_blocks(req("2", tokens))[1] == 0
    assert kvm.get_computed_blocks(req("3", tokens, lora_name="other"))[1] == 0


def test_eagle_drops_the_last_hit_block() -> None:
    for num_tokens in (3 * BS, 2 * BS + 5):
        kvm = manager(10, use_eagle=True)
        tokens = [0] * num_tokens
        r = req("prime", tokens)
        hits, n = kvm.get_computed_blocks(r)
        kvm.allocate_slots(r, num_tokens, n, hits)
        kvm.free(r)
        hits, n = kvm.get_computed_blocks(req("eagle", tokens))
        assert len(hits.blocks[0]) == 1 and n == BS


def test_eagle_with_sliding_window() -> None:
    kvm = manager(10, sliding(1), use_eagle=True)
    tokens = [0] * (2 * BS + 5)
    r = req("prime", tokens)
    hits, n = kvm.get_computed_blocks(r)
    kvm.allocate_slots(r, len(tokens), n, hits)
    first = r.block_hashes[0]
    kvm.free(r)
    hits, n = kvm.get_computed_blocks(req("eagle", tokens))
    assert len(hits.blocks[0]) == 1 and n == BS
    assert kvm.block_pool.get_cached_block(first, kv_cache_group_ids=[0]) is not None
    kvm.block_pool.cached_block_hash_to_block._cache.pop(make_block_hash_with_group_id(first, 0))
    hits, n = kvm.get_computed_blocks(req("after_evict", tokens))
    assert len(hits.blocks[0]) == 0 and n == 0


def test_lookahead_slots_count_toward_blocks() -> None:
    class EmptyRequest:
        request_id = "0"
        all_token_ids: tuple[int, ...] = ()
        num_tokens = 0
        block_hashes: tuple[BlockHash, ...] = ()
        num_computed_tokens = 0
        lora_name = None
        lora_path = None
        cache_salt = None
        mm_features = ()
        skip_reading_prefix_cache = False

    for lookahead, expected in ((2, 2), (4, 2), (6, 3)):
        kvm = KVCacheManager(config(10, full(4)), 100, hash_block_size=4)
        new = kvm.allocate_slots(EmptyRequest(), 3, num_lookahead_tokens=lookahead)
        assert new is not None and len(new.get_block_ids()[0]) == expected


def test_num_common_prefix_blocks_counts_blocks_every_request_holds() -> None:
    kvm = manager(20)
    r0 = req("0", COMMON + [5] * 20)
    kvm.allocate_slots(r0, r0.num_tokens)
    assert kvm.get_num_common_prefix_blocks("0") == [5]  # alone: all its blocks
    r1 = req("1", COMMON[:32] + [6] * 20)
    hits, n = kvm.get_computed_blocks(r1)
    kvm.allocate_slots(r1, r1.num_tokens - n, n, hits)
    assert kvm.get_num_common_prefix_blocks("0") == [2]
    assert kvm.get_num_common_prefix_blocks("1") == [2]
    r2 = req("2", [9] * 20)
    kvm.allocate_slots(r2, 20)
    assert kvm.get_num_common_prefix_blocks("0") == [0]
    kvm.free(r2)
    assert kvm.get_num_common_prefix_blocks("1") == [2]


# --------------------------------------------------------------------- hybrid
def hybrid(num_blocks: int, window_blocks: int = 2, second: str = "sliding") -> KVCacheManager:
    other: KVCacheSpec = sliding(window_blocks) if second == "sliding" else mamba()
    return manager(num_blocks, full(), other, other)


def partial_hit(
    kvm: KVCacheManager,
    tokens: list[int],
    rid: str,
    evict: list[bytes],
    num_full_blocks: int,
    expect_blocks: int,
) -> None:
    """Drop `evict` from the index, look up, check the hit, restore the index."""
    cache = kvm.block_pool.cached_block_hash_to_block._cache
    saved = {k: cache[k] for k in evict}
    for key in evict:
        cache.pop(key)
    r = req(rid, tokens)
    hits, n = kvm.get_computed_blocks(r)
    assert len(r.block_hashes) == num_full_blocks
    assert n == expect_blocks * BS
    for group in hits.blocks:
        assert len(group) == expect_blocks
    cache.update(saved)


def test_prefill_hybrid_full_and_sliding_window() -> None:
    kvm = hybrid(21)
    tokens0 = COMMON + [3] * 7
    r0 = req("0", tokens0)
    hits, n = kvm.get_computed_blocks(r0)
    assert n == 0 and not hits.blocks[0]
    new = kvm.allocate_slots(r0, 55, 0, hits)
    assert new is not None
    assert new.get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    parent: BlockHash | None = None
    for i, ids in enumerate(((1, 5, 9), (2, 6, 10), (3, 7, 11))):
        expected = hash_block_tokens(sha256, parent, tokens0[i * BS : (i + 1) * BS])
        for group_id, block_id in enumerate(ids):
            blk_hash = kvm.block_pool.blocks[block_id].block_hash
            assert blk_hash is not None
            assert get_block_hash(blk_hash) == expected and get_group_id(blk_hash) == group_id
        parent = expected
    assert all(kvm.block_pool.blocks[i].block_hash is None for i in (4, 8, 12))

    tokens1 = COMMON + [3] * 5
    r1 = req("1", tokens1)
    hits, n = kvm.get_computed_blocks(r1)
    # The window needs the last 2 blocks; earlier positions are the null block.
    assert hits.get_block_ids() == ([1, 2, 3], [0, 6, 7], [0, 10, 11]) and n == 48
    new = kvm.allocate_slots(r1, 5, 48, hits)
    assert new is not None and new.get_block_ids() == ([13], [14], [15])
    for group in hits.blocks:
        for blk in group:
            if not blk.is_null:
                assert blk.ref_cnt == 2
    h = r1.block_hashes
    kvm.free(r0)
    kvm.free(r1)

    def key(i: int, g: int) -> bytes:
        return make_block_hash_with_group_id(h[i], g)

    partial_hit(kvm, tokens1, "2", [key(0, 1), key(0, 2)], 3, 3)  # outside the window
    partial_hit(kvm, tokens1, "3", [key(0, 0)], 3, 0)  # full attention's first block
    partial_hit(kvm, tokens1, "4", [key(2, 0), key(2, 1), key(2, 2)], 3, 2)
    partial_hit(kvm, tokens1, "5", [key(2, 0)], 3, 2)
    partial_hit(kvm, tokens1, "6", [key(2, 1)], 3, 2)
    partial_hit(kvm, tokens1, "7", [key(2, 2)], 3, 2)
    # Full attention hits 1 block, the window 2 blocks elsewhere: no common length.
    partial_hit(kvm, tokens1, "8", [key(2, 0), key(0, 1), key(0, 2)], 3, 0)


def test_prefill_hybrid_eagle() -> None:
    kvm = manager(31, full(), sliding(3), sliding(3), use_eagle=True)
    common = [i for i in range(6) for _ in range(BS)]
    tokens0 = common + [6] * 7
    r0 = req("0", tokens0)
    hits, n = kvm.get_computed_blocks(r0)
    new = kvm.allocate_slots(r0, len(tokens0), n, hits)
    assert new is not None and new.get_block_ids() == (
        [1, 2, 3, 4, 5, 6, 7],
        [8, 9, 10, 11, 12, 13, 14],
        [15, 16, 17, 18, 19, 20, 21],
    )
    tokens1 = common + [6] * 5
    r1 = req("1", tokens1)
    hits, n = kvm.get_computed_blocks(r1)
    assert hits.get_block_ids() == ([1, 2, 3, 4, 5], [0, 0, 10, 11, 12], [0, 0, 17, 18, 19])
    assert n == 5 * BS
    new = kvm.allocate_slots(r1, len(tokens1) - n, n, hits)
    assert new is not None and new.get_block_ids() == ([22, 23], [24, 25], [26, 27])
    h = r1.block_hashes
    kvm.free(r0)
    kvm.free(r1)

    def key(i: int, g: int) -> bytes:
        return make_block_hash_with_group_id(h[i], g)

    partial_hit(kvm, tokens1, "2", [key(0, 1), key(0, 2)], 6, 5)
    partial_hit(kvm, tokens1, "3", [key(0, 0)], 6, 0)
    partial_hit(kvm, tokens1, "4", [key(5, 0), key(5, 1), key(5, 2)], 6, 4)
    partial_hit(kvm, tokens1, "5", [key(5, 0)], 6, 4)
    partial_hit(kvm, tokens1, "6", [key(4, 1)], 6, 3)
    partial_hit(kvm, tokens1, "7", [key(4, 2)], 6, 3)


@pytest.mark.parametrize(
    "kinds",
    [
        ("full", "sliding"),
        ("full", "mamba"),
        ("sliding", "mamba"),
        ("sliding", "sliding_large"),
        ("full", "sliding", "sliding"),
        ("full", "mamba", "mamba"),
        ("full", "sliding", "mamba"),
        ("full", "sliding", "sliding_large"),
        ("full", "full", "sliding"),
        ("full", "sliding", "full", "sliding_large"),
        ("full", "mamba", "full", "mamba"),
        ("sliding", "mamba", "sliding_large", "mamba"),
        ("full", "full", "sliding", "mamba"),
    ],
)
def test_prefill_hybrid_combinations_hit_the_shared_prefix(kinds: tuple[str, ...]) -> None:
    make: dict[str, Callable[[], KVCacheSpec]] = {
        "full": full,
        "sliding": lambda: sliding(2),
        "sliding_large": lambda: sliding(4),
        "mamba": mamba,
    }
    kvm = manager(10 * len(kinds), *(make[k]() for k in kinds))
    r0 = req("0", COMMON + [3] * 7)
    hits, n = kvm.get_computed_blocks(r0)
    assert n == 0
    new = kvm.allocate_slots(r0, 55, 0, hits)
    assert new is not None and len(new.get_block_ids()) == len(kinds)
    r1 = req("1", COMMON + [4] * 5)
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 48 and len(hits.blocks) == len(kinds)
    assert all(len(g) == 3 for g in hits.blocks)
    new = kvm.allocate_slots(r1, 53 - n, n, hits)
    assert new is not None and len(new.get_block_ids()) == len(kinds)
    kvm.free(r0)
    kvm.free(r1)
    kvm.check_integrity()


def test_mamba_hybrid_hit_keeps_only_the_last_state_block() -> None:
    kvm = hybrid(30, second="mamba")
    r0 = req("0", COMMON + [3] * 7)
    kvm.allocate_slots(r0, 55)
    hits, n = kvm.get_computed_blocks(req("1", [*COMMON, 4]))
    assert n == 48
    ids = hits.get_block_ids()
    assert ids[0] == [1, 2, 3]
    # Mamba groups: null padding, then the block holding the state at token 48.
    assert ids[1][:2] == [0, 0] and ids[2][:2] == [0, 0]
    assert ids[1][2] != 0 and ids[2][2] != 0


def test_hybrid_eagle_full_plus_sliding_drops_one_block_once() -> None:
    kvm = manager(20, full(), sliding(2), use_eagle=True)
    common = [i for i in range(4) for _ in range(BS)]
    r0 = req("0", common + [4] * 7)
    hits, n = kvm.get_computed_blocks(r0)
    assert n == 0
    kvm.allocate_slots(r0, r0.num_tokens, n, hits)
    r1 = req("1", common + [6] * 5)
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 3 * BS and all(len(g) == 3 for g in hits.blocks)
    new = kvm.allocate_slots(r1, r1.num_tokens - n, n, hits)
    assert new is not None
    kvm.free(r0)
    kvm.free(r1)
    kvm.check_integrity()


def chunked_local(chunk: int, block_size: int) -> KVCacheSpec:
    from paged.kvcache import ChunkedLocalAttentionSpec

    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype="float32",
        attention_chunk_size=chunk,
    )


def test_sliding_window_frees_left_blocks_to_the_tail_and_pads_with_null() -> None:
    kvm = KVCacheManager(config(11, sliding(2, 4)), 1024, hash_block_size=4)  # window 8
    r0 = req("0", list(range(20)), 4)
    new = kvm.allocate_slots(r0, 20)
    assert new is not None and new.get_block_ids() == ([1, 2, 3, 4, 5],)
    r0.num_computed_tokens = 20
    r0.append_output_token_ids(7)
    new = kvm.allocate_slots(r0, 1)
    # Token 20 sees tokens 13..20: blocks 0..2 left the window. They were cached,
    # so they go to the tail (tail first), behind the never-used blocks.
    assert new is not None and new.get_block_ids() == ([6],)
    assert kvm.get_block_ids("0") == ([0, 0, 0, 4, 5, 6],)
    assert free_queue_ids(kvm) == [7, 8, 9, 10, 3, 2, 1]
    # Freed blocks stay cached: a lookup of the prefix (at most 19 tokens, so 4
    # blocks) finds the two blocks the window needs, block 3 among the free ones.
    hits, n = kvm.get_computed_blocks(req("1", list(range(20)), 4))
    assert hits.get_block_ids() == ([0, 0, 3, 4],) and n == 16


def test_sliding_window_frees_even_when_the_allocation_fails() -> None:
    kvm = KVCacheManager(config(5, sliding(2, 4)), 1024, hash_block_size=4)
    r0 = req("0", list(range(16)), 4)
    assert kvm.allocate_slots(r0, 16) is not None  # blocks 1..4, pool empty
    r0.num_computed_tokens = 16
    r0.append_output_token_ids([1] * 9)
    # 9 new tokens need 3 blocks; the window frees 2 (blocks 1, 2): not enough,
    # but the 2 stay freed.
    assert kvm.allocate_slots(r0, 9) is None
    assert kvm.get_block_ids("0") == ([0, 0, 3, 4],)
    assert kvm.block_pool.get_num_free_blocks() == 2
    kvm.check_integrity()


def test_chunked_local_counts_earlier_chunks_as_computed_with_an_empty_cache() -> None:
    kvm = KVCacheManager(config(20, chunked_local(8, 4)), 1024, hash_block_size=4)
    r = req("0", list(range(20)), 4)
    hits, n = kvm.get_computed_blocks(r)
    # At most 19 tokens hit; 16 of them are before the current chunk [16, 24).
    assert hits.get_block_ids() == ([0, 0, 0, 0],) and n == 16
    new = kvm.allocate_slots(r, 4, n, hits)
    assert new is not None and new.get_block_ids() == ([1],)
    assert kvm.block_pool.get_num_free_blocks() == 18


def test_mamba_keeps_the_last_state_and_hits_the_rightmost_block() -> None:
    kvm = KVCacheManager(config(11, mamba(4)), 1024, hash_block_size=4)
    r0 = req("0", list(range(12)), 4)
    new = kvm.allocate_slots(r0, 12)
    assert new is not None and new.get_block_ids() == ([1, 2, 3],)
    r0.num_computed_tokens = 12
    r0.append_output_token_ids(5)
    new = kvm.allocate_slots(r0, 1)
    # Only the state after token 12 (block 3) is still needed.
    assert new is not None and kvm.get_block_ids("0") == ([0, 0, 3, 4],)
    hits, n = kvm.get_computed_blocks(req("1", [*range(12), 9], 4))
    assert hits.get_block_ids() == ([0, 0, 3],) and n == 12
