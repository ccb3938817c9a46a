"""KVCacheManager with one full-attention group: exact block ids and orders."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from paged.kvcache import KVCacheManager, SimpleRequest

MakeManager = Callable[..., KVCacheManager]
MakeRequest = Callable[..., SimpleRequest]


def free_ids(kvm: KVCacheManager) -> list[int]:
    return [b.block_id for b in kvm.block_pool.free_block_queue.get_all_free_blocks()]


def schedule(
    kvm: KVCacheManager, req: SimpleRequest, num_new_tokens: int | None = None
) -> list[int]:
    """Prefix lookup + allocation of the whole known sequence, like a scheduler admitting it."""
    hits, num_hit = kvm.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    new = kvm.allocate_slots(req, n, num_hit, hits)
    assert new is not None
    req.num_computed_tokens += num_hit + n
    return kvm.get_block_ids(req.request_id)[0]


def test_prefix_hit_and_exact_ids(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11)
    r0 = make_request("0", range(10))  # blocks [0..4) [4..8) [8..10)
    hits, n = kvm.get_computed_blocks(r0)
    assert n == 0 and hits.get_block_ids() == ([],)
    new = kvm.allocate_slots(r0, 10)
    assert new is not None and new.get_block_ids() == ([1, 2, 3],)
    r0.num_computed_tokens = 10
    # Full blocks are cached at allocation time: a request in the same step hits them.
    r1 = make_request("1", [*range(8), 50, 51, 52])
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 8 and hits.get_block_ids() == ([1, 2],)
    new = kvm.allocate_slots(r1, 3, n, hits)
    assert new is not None and new.get_block_ids() == ([4],)
    assert kvm.get_block_ids("1") == ([1, 2, 4],)
    assert [kvm.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert kvm.get_num_common_prefix_blocks("0") == [2]
    kvm.check_integrity()


def test_last_token_always_recomputed(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11)
    r0 = make_request("0", range(8))
    assert schedule(kvm, r0) == [1, 2]
    r1 = make_request("1", range(8))
    hits, n = kvm.get_computed_blocks(r1)
    # 8 tokens all cached, but at most 7 may hit: only block 0 (4 tokens) counts.
    assert n == 4 and hits.get_block_ids() == ([1],)


def test_skip_reading_prefix_cache(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11)
    schedule(kvm, make_request("0", range(9)))
    r1 = make_request("1", range(9), skip_reading_prefix_cache=True)
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 0 and hits.get_block_ids() == ([],)


def test_free_order_uncached_front_cached_tail_reversed(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(11)
    r0 = make_request("0", range(10))
    assert schedule(kvm, r0) == [1, 2, 3]
    assert free_ids(kvm) == [4, 5, 6, 7, 8, 9, 10]
    kvm.free(r0)
    # Block 3 holds 2 tokens (not cached): front. Cached 2, 1 go to the tail
    # in reverse order, so the prefix block 1 is evicted last.
    assert free_ids(kvm) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    kvm.check_integrity()


def test_eviction_order_lru(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(7)  # usable blocks 1..6
    ra = make_request("a", range(8))
    rb = make_request("b", range(100, 108))
    assert schedule(kvm, ra) == [1, 2]
    assert schedule(kvm, rb) == [3, 4]
    kvm.free(ra)
    kvm.free(rb)
    assert free_ids(kvm) == [5, 6, 2, 1, 4, 3]
    rc = make_request("c", range(200, 216))  # 4 blocks: takes 5, 6, then evicts 2, 1
    assert schedule(kvm, rc) == [5, 6, 2, 1]
    # Block 1 (a's prefix) was evicted: a gets no hit now, b still hits block 3.
    assert kvm.get_computed_blocks(make_request("a2", range(9)))[1] == 0
    hits, n = kvm.get_computed_blocks(make_request("b2", range(100, 109)))
    assert n == 8 and hits.get_block_ids() == ([3, 4],)
    kvm.check_integrity()


def test_hit_on_free_block_costs_capacity(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(4)  # usable blocks 1..3
    r0 = make_request("0", range(8))
    assert schedule(kvm, r0) == [1, 2]
    kvm.free(r0)
    # Free queue: 3, 2, 1. r1 (9 tokens) hits blocks 1 and 2 and needs 1 new block:
    # 2 hits taken from the free queue + 1 new = 3 = all free blocks: fits.
    r1 = make_request("1", range(9))
    assert schedule(kvm, r1) == [1, 2, 3]
    kvm.free(r1)
    # Block 3 holds 1 uncached token: front. r2 (13 tokens) hits 1, 2 and needs 2 more.
    r2 = make_request("2", [*range(8), 7, 7, 7, 7, 7])
    hits, n = kvm.get_computed_blocks(r2)
    assert n == 8
    assert kvm.allocate_slots(r2, 5, n, hits) is None  # 2 hits from the queue + 2 new > 3
    kvm.check_integrity()
    assert free_ids(kvm) == [3, 2, 1]  # nothing changed


def test_hit_on_block_in_use_costs_nothing(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(5)  # usable blocks 1..4
    r0 = make_request("0", range(9))
    assert schedule(kvm, r0) == [1, 2, 3]
    assert free_ids(kvm) == [4]
    # Hits on blocks 1 and 2, which r0 holds: only the one new block counts.
    r1 = make_request("1", [*range(8), 77])
    assert schedule(kvm, r1) == [1, 2, 4]
    kvm.check_integrity()


def test_decode_allocates_block_at_boundary_and_caches(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(11, enable_kv_cache_events=False)
    r0 = make_request("0", range(3))
    assert schedule(kvm, r0) == [1]
    r0.append_output_token_ids(3)  # 4 tokens: block 1 is full now
    new = kvm.allocate_slots(r0, 1)
    assert new is not None and new.get_block_ids() == ([],)
    assert kvm.block_pool.blocks[1].block_hash is not None
    r0.num_computed_tokens += 1
    r0.append_output_token_ids(4)
    new = kvm.allocate_slots(r0, 1)
    assert new is not None and new.get_block_ids() == ([2],)
    assert kvm.get_block_ids("0") == ([1, 2],)


def test_lookahead_slots_not_cached(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11)
    r0 = make_request("0", range(4))
    new = kvm.allocate_slots(r0, 4, num_lookahead_tokens=5)
    assert new is not None and new.get_block_ids() == ([1, 2, 3],)
    assert kvm.block_pool.blocks[1].block_hash is not None
    assert kvm.block_pool.blocks[2].block_hash is None  # draft slots never cached


def test_delay_cache_blocks_then_cache(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(11)
    r0 = make_request("0", range(9))
    assert kvm.allocate_slots(r0, 9, delay_cache_blocks=True) is not None
    assert all(kvm.block_pool.blocks[i].block_hash is None for i in (1, 2, 3))
    kvm.cache_blocks(r0, 9)
    assert [kvm.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [
        True,
        True,
        False,
    ]
    kvm.check_integrity()


def test_external_computed_tokens(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11)
    r0 = make_request("0", range(12))
    # 8 tokens loaded by a connector, 4 to compute: blocks for all 12.
    new = kvm.allocate_slots(r0, 4, num_external_computed_tokens=8)
    assert new is not None and new.get_block_ids() == ([3],)
    assert kvm.get_block_ids("0") == ([1, 2, 3],)
    kvm.check_integrity()


def test_max_model_len_caps_slots(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11, max_model_len=8)
    r0 = make_request("0", range(6))
    assert kvm.allocate_slots(r0, 6, num_lookahead_tokens=10) is not None
    assert kvm.get_block_ids("0") == ([1, 2],)


def test_reset_prefix_cache(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11, log_stats=True, enable_kv_cache_events=True)
    r0 = make_request("0", range(9))
    schedule(kvm, r0)
    assert kvm.reset_prefix_cache() is False
    kvm.free(r0)
    kvm.take_events()
    assert kvm.reset_prefix_cache() is True
    assert len(kvm.block_pool.cached_block_hash_to_block) == 0
    assert kvm.get_computed_blocks(make_request("1", range(9)))[1] == 0
    stats = kvm.make_prefix_cache_stats()
    assert stats is not None and stats.reset and stats.requests == 2 and stats.hits == 0
    assert [type(e).__name__ for e in kvm.take_events()] == ["AllBlocksCleared"]
    kvm.check_integrity()


def test_prefix_cache_stats(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11, log_stats=True)
    schedule(kvm, make_request("0", range(9)))
    schedule(kvm, make_request("1", range(10)))
    stats = kvm.make_prefix_cache_stats()
    assert stats is not None
    assert (stats.requests, stats.queries, stats.hits) == (2, 19, 8)
    fresh = kvm.make_prefix_cache_stats()
    assert fresh is not None and fresh.requests == 0
    assert make_manager(11).make_prefix_cache_stats() is None


def test_caching_disabled(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11, enable_caching=False)
    r0 = make_request("0", range(9))
    assert schedule(kvm, r0) == [1, 2, 3]
    assert kvm.get_computed_blocks(make_request("1", range(9)))[1] == 0
    assert all(b.block_hash is None for b in kvm.block_pool.blocks)
    kvm.free(r0)
    assert free_ids(kvm)[:3] == [3, 2, 1]  # uncached blocks go to the front
    assert kvm.get_num_common_prefix_blocks is not None
    kvm.check_integrity()


def test_usage(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(5)  # 4 usable blocks
    assert kvm.usage == 0.0
    schedule(kvm, make_request("0", range(5)))
    assert kvm.usage == pytest.approx(0.5)
