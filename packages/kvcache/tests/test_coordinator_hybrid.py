"""Hybrid coordinator: the fixed-point hit length, block sizes, attention groups."""

from __future__ import annotations

from collections.abc import Callable

from paged.kvcache import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    KVCacheManager,
    SimpleRequest,
    SlidingWindowSpec,
    UnitaryKVCacheCoordinator,
)

MakeManager = Callable[..., KVCacheManager]
MakeRequest = Callable[..., SimpleRequest]
BS = 4
ATTN = {"num_kv_heads": 1, "head_size": 8, "dtype": "float32"}


def full(bs: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, **ATTN)  # type: ignore[arg-type]


def sw(window: int, bs: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, sliding_window=window, **ATTN)  # type: ignore[arg-type]


def test_coordinator_selection(make_manager: MakeManager) -> None:
    assert isinstance(make_manager(5).coordinator, UnitaryKVCacheCoordinator)
    assert isinstance(make_manager(5, full(), sw(5)).coordinator, HybridKVCacheCoordinator)
    assert isinstance(
        make_manager(5, enable_caching=False).coordinator, KVCacheCoordinatorNoPrefixCache
    )


def test_hybrid_allocates_per_group(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11, full(), sw(9))
    r0 = make_request("0", range(16))
    new = kvm.allocate_slots(r0, 16)
    assert new is not None and new.get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8])
    r0.num_computed_tokens = 16
    hits, n = kvm.get_computed_blocks(make_request("1", range(20)))
    assert n == 16 and hits.get_block_ids() == ([1, 2, 3, 4], [0, 0, 3 + 4, 4 + 4])
    kvm.check_integrity()


def test_hybrid_hit_is_agreed_length_not_min_of_separate_hits(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(11, full(), sw(9))  # SW needs 2 contiguous blocks
    r0 = make_request("0", range(16))
    assert kvm.allocate_slots(r0, 16) is not None
    kvm.free(r0)
    kvm.evict_blocks([4, 6])  # full position 3, sliding-window position 1
    r1 = make_request("1", range(20))
    # Separately: full hits 12 tokens, sliding window (max 19) hits 16. The minimum
    # (12) is not valid for the window: at 12 it needs positions 1-2, and 1 is gone.
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 4 and hits.get_block_ids() == ([1], [5])
    assert kvm.allocate_slots(r1, 16, n, hits) is not None
    # Free queue was [9, 10, 4, 3, 2, 1, 8, 7, 6, 5]; hits 1 and 5 leave it, then
    # group 0 takes four blocks from the front and group 1 the next four.
    assert kvm.get_block_ids("1") == ([1, 9, 10, 4, 3], [5, 2, 8, 7, 6])
    kvm.check_integrity()


def test_three_types_reach_fixed_point(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    chunked = ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=8, **ATTN)  # type: ignore[arg-type]
    kvm = make_manager(40, full(), sw(9), chunked)
    coord = kvm.coordinator
    assert isinstance(coord, HybridKVCacheCoordinator) and not coord.is_simple_hybrid
    r0 = make_request("0", range(24))
    assert kvm.allocate_slots(r0, 24) is not None
    assert kvm.get_block_ids("0") == (
        [1, 2, 3, 4, 5, 6],
        [7, 8, 9, 10, 11, 12],
        [13, 14, 15, 16, 17, 18],
    )
    kvm.free(r0)
    kvm.evict_blocks([17, 9])  # chunked position 4, sliding-window position 2
    # Round 1 (max 23): full 20, window 20 (positions 3-4), chunked 16 (position 4 gone).
    # Round 2 (16): the window now needs positions 2-3; 2 is gone: 8. Chunked at 8: 8.
    # Round 3 (8): everyone agrees. The minimum of separate hits would be 16.
    hits, n = kvm.get_computed_blocks(make_request("1", range(24)))
    assert n == 8
    assert hits.get_block_ids() == ([1, 2], [7, 8], [0, 0])


def test_hybrid_block_size_multiple_of_hash_block_size(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(20, full(4), sw(9, bs=8))
    assert kvm.hash_block_size == 4
    r0 = make_request("0", range(16))
    assert kvm.allocate_slots(r0, 16) is not None
    assert kvm.get_block_ids("0") == ([1, 2, 3, 4], [5, 6])
    # The window (9 tokens, 8-token blocks) needs one block before the boundary.
    hits, n = kvm.get_computed_blocks(make_request("1", range(20)))
    assert n == 16 and hits.get_block_ids() == ([1, 2, 3, 4], [0, 6])
    # Hits are aligned to lcm(4, 8) = 8 tokens: 15 usable tokens give 8, not 12.
    hits, n = kvm.get_computed_blocks(make_request("2", [*range(12), 7, 7, 7, 7]))
    assert n == 8 and hits.get_block_ids() == ([1, 2], [5])
    kvm.check_integrity()
