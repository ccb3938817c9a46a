"""Sliding window, chunked local, mamba, cross-attention and sink managers: exact ids."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from paged.kvcache import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    SimpleRequest,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

MakeManager = Callable[..., KVCacheManager]
MakeRequest = Callable[..., SimpleRequest]
BS = 4
ATTN = {"num_kv_heads": 1, "head_size": 8, "dtype": "float32"}


def sw(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, sliding_window=window, **ATTN)  # type: ignore[arg-type]


def free_ids(kvm: KVCacheManager) -> list[int]:
    return [b.block_id for b in kvm.block_pool.free_block_queue.get_all_free_blocks()]


def admit(kvm: KVCacheManager, req: SimpleRequest) -> tuple[list[int], ...]:
    hits, n = kvm.get_computed_blocks(req)
    assert kvm.allocate_slots(req, req.num_tokens - n, n, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return kvm.get_block_ids(req.request_id)


def test_sliding_window_frees_blocks_outside_window(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(9, sw(5))
    r0 = make_request("0", range(14))
    assert admit(kvm, r0) == ([1, 2, 3, 4],)
    r0.append_output_token_ids(14)
    new = kvm.allocate_slots(r0, 1)
    # 14 computed tokens: the next token sees tokens 10..14; blocks 0 and 1 are skipped.
    assert new is not None and new.get_block_ids() == ([],)
    assert kvm.get_block_ids("0") == ([0, 0, 3, 4],)
    assert free_ids(kvm) == [5, 6, 7, 8, 2, 1]  # cached, freed tail first
    assert kvm.get_num_common_prefix_blocks("0") == [0]
    kvm.check_integrity()
    # A request sharing 12 tokens needs only the last block in its window.
    r1 = make_request("1", [*range(12), 99, 98, 97, 96])
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 12 and hits.get_block_ids() == ([0, 0, 3],)
    assert kvm.allocate_slots(r1, 4, n, hits) is not None
    assert kvm.get_block_ids("1") == ([0, 0, 3, 5],)
    assert kvm.block_pool.blocks[3].ref_cnt == 2
    kvm.check_integrity()


def test_sliding_window_frees_even_when_allocation_fails(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(5, sw(5))
    r0 = make_request("0", range(16))
    assert admit(kvm, r0) == ([1, 2, 3, 4],)
    r0.append_output_token_ids(16)
    assert kvm.allocate_slots(r0, 1, num_lookahead_tokens=12) is None
    assert kvm.get_block_ids("0") == ([0, 0, 0, 4],)
    assert free_ids(kvm) == [3, 2, 1]
    kvm.check_integrity()


def test_sliding_window_lookup_needs_contiguous_window(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(9, sw(9))  # the next token needs 2 contiguous blocks
    r0 = make_request("0", range(16))
    assert admit(kvm, r0) == ([1, 2, 3, 4],)
    kvm.free(r0)
    kvm.evict_blocks([3])  # block position 2
    hits, n = kvm.get_computed_blocks(make_request("1", range(20)))
    # Position 3 hits alone (not enough); positions 0-1 form a run from the start.
    assert n == 8 and hits.get_block_ids() == ([1, 2],)
    kvm.evict_blocks([1])
    hits, n = kvm.get_computed_blocks(make_request("2", range(20)))
    assert n == 0


def test_chunked_local_counts_earlier_chunks_as_computed(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    spec = ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=8, **ATTN)  # type: ignore[arg-type]
    kvm = make_manager(9, spec)
    r0 = make_request("0", range(20))
    hits, n = kvm.get_computed_blocks(r0)
    assert n == 16 and hits.get_block_ids() == ([0, 0, 0, 0],)  # empty cache
    assert kvm.allocate_slots(r0, 4, n, hits) is not None
    assert kvm.get_block_ids("0") == ([0, 0, 0, 0, 1],)
    assert free_ids(kvm) == [2, 3, 4, 5, 6, 7, 8]
    r0.num_computed_tokens = 20
    r0.append_output_token_ids(range(20, 25))
    assert kvm.allocate_slots(r0, 5) is not None  # 25 tokens: positions 5, 6 new
    assert kvm.get_block_ids("0") == ([0, 0, 0, 0, 1, 2, 3],)
    r0.num_computed_tokens = 25
    r0.append_output_token_ids(25)
    assert kvm.allocate_slots(r0, 1) is not None  # chunk [16, 24) now skipped
    assert kvm.get_block_ids("0") == ([0, 0, 0, 0, 0, 0, 3],)
    kvm.check_integrity()


def test_mamba_keeps_last_state_and_hits_rightmost(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    # "all" mode: every full block is cached (the kernels write each block's state).
    spec = MambaSpec(block_size=BS, shapes=((2, 8),), dtypes=("float32",), mamba_cache_mode="all")
    kvm = make_manager(9, spec)
    r0 = make_request("0", range(10))
    assert admit(kvm, r0) == ([1, 2, 3],)
    r0.append_output_token_ids(10)
    assert kvm.allocate_slots(r0, 1) is not None
    assert kvm.get_block_ids("0") == ([0, 0, 3],)  # only the state at token 9 is kept
    assert free_ids(kvm) == [4, 5, 6, 7, 8, 2, 1]
    r1 = make_request("1", [*range(10), 50, 51])
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 8 and hits.get_block_ids() == ([0, 2],)  # rightmost hit, nulls before
    assert kvm.allocate_slots(r1, 4, n, hits) is not None
    assert kvm.get_block_ids("1") == ([0, 2, 4],)
    kvm.check_integrity()


def test_cross_attention_allocates_once_and_disables_prefix_hits(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    full = FullAttentionSpec(block_size=BS, **ATTN)  # type: ignore[arg-type]
    cross = CrossAttentionSpec(block_size=BS, **ATTN)  # type: ignore[arg-type]
    kvm = make_manager(11, full, cross)
    r0 = make_request("0", range(5))
    new = kvm.allocate_slots(r0, 5, num_encoder_tokens=6)
    assert new is not None and new.get_block_ids() == ([1, 2], [3, 4])
    r0.num_computed_tokens = 5
    r0.append_output_token_ids(range(5, 9))
    assert kvm.allocate_slots(r0, 4) is not None
    assert kvm.get_block_ids("0") == ([1, 2, 5], [3, 4])  # encoder blocks do not grow
    hits, n = kvm.get_computed_blocks(make_request("1", range(9)))
    assert n == 0 and hits.get_block_ids() == ([], [])
    kvm.free(r0)
    kvm.check_integrity()


def test_sink_blocks_are_reserved(make_manager: MakeManager, make_request: MakeRequest) -> None:
    spec = SinkFullAttentionSpec(block_size=BS, sink_len=8, **ATTN)  # type: ignore[arg-type]
    kvm = make_manager(7, spec)
    assert free_ids(kvm) == [3, 4, 5, 6]
    assert kvm.usage == 0.0
    r0 = make_request("0", range(5))
    assert admit(kvm, r0) == ([3, 4],)
    assert kvm.usage == pytest.approx(0.5)
    kvm.check_integrity()
    kvm.free(r0)
    assert kvm.reset_prefix_cache() is True
    kvm.check_integrity()


def test_spec_block_size_must_divide() -> None:
    with pytest.raises(ValueError, match="sink_len"):
        SinkFullAttentionSpec(block_size=BS, sink_len=6, **ATTN)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention_chunk_size"):
        ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=6, **ATTN)  # type: ignore[arg-type]
