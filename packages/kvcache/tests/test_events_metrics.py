"""Manager-level events (store/remove order, hits not stored again) and residency metrics."""

from __future__ import annotations

import random
from collections.abc import Callable

from paged.kvcache import (
    BlockRemoved,
    BlockStored,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheManager,
    KVCacheMetricsCollector,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SimpleRequest,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    kv_cache_spec_kind,
    kv_cache_spec_sliding_window,
)

MakeManager = Callable[..., KVCacheManager]
MakeRequest = Callable[..., SimpleRequest]


def test_events_through_manager(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(5, enable_kv_cache_events=True)  # 4 usable blocks
    r0 = make_request("0", range(9))
    assert kvm.allocate_slots(r0, 9) is not None
    (stored,) = kvm.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == r0.block_hashes[:2] and stored.parent_block_hash is None
    r0.num_computed_tokens = 9
    r0.append_output_token_ids([9, 10, 11])
    assert kvm.allocate_slots(r0, 3) is not None
    (more,) = kvm.take_events()
    assert isinstance(more, BlockStored)
    assert more.block_hashes == [r0.block_hashes[2]]
    assert more.parent_block_hash == r0.block_hashes[1] and more.token_ids == [8, 9, 10, 11]
    kvm.free(r0)
    # Free queue: 4, 3, 2, 1. r1 hits 1 and 2 (not stored again) and takes 4 and 3;
    # taking 3 evicts r0's third block: its removal comes before r1's store.
    r1 = make_request("1", [*range(8), 50, 51, 52, 53, 54])
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 8
    new = kvm.allocate_slots(r1, 5, n, hits)
    assert new is not None and new.get_block_ids() == ([4, 3],)
    events = kvm.take_events()
    assert events[0] == BlockRemoved(block_hashes=[r0.block_hashes[2]], group_idx=0)
    assert isinstance(events[1], BlockStored)
    assert events[1].block_hashes == [r1.block_hashes[2]]
    assert events[1].parent_block_hash == r1.block_hashes[1]
    assert kvm.take_events() == []


def test_events_off_by_default(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11)
    assert kvm.allocate_slots(make_request("0", range(9)), 9) is not None
    assert kvm.take_events() == []


def test_metrics_collector_lifetime_idle_reuse(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    now = [0.0]
    collector = KVCacheMetricsCollector(sample_rate=1.0, clock=lambda: now[0], rng=random.Random(0))
    kvm = make_manager(3, metrics_collector=collector)  # 2 usable blocks
    r0 = make_request("0", range(5))
    assert kvm.allocate_slots(r0, 5) is not None  # blocks 1, 2 at t=0
    kvm.free(r0)
    now[0] = 1.0
    r1 = make_request("1", range(5))
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 4
    assert kvm.allocate_slots(r1, 1, n, hits) is not None  # touches 1 at t=1, reuses 2
    kvm.free(r1)
    now[0] = 3.0
    assert kvm.allocate_slots(make_request("2", range(100, 108)), 8) is not None
    events = {e.block_id: e for e in collector.drain_events()}
    assert events[2].lifetime_seconds == 2.0  # reallocated at t=1, evicted at t=3
    assert events[1].lifetime_seconds == 3.0 and events[1].idle_seconds == 2.0
    assert events[1].reuse_gaps_seconds == (1.0,)
    assert collector.drain_events() == []


def test_metrics_sampling_rate() -> None:
    collector = KVCacheMetricsCollector(sample_rate=0.0)
    assert not collector.should_sample_block()
    try:
        KVCacheMetricsCollector(sample_rate=2.0)
    except ValueError as e:
        assert "sample_rate" in str(e)
    else:
        raise AssertionError("sample_rate=2.0 was accepted")


def test_stores_carry_their_groups_spec_kind_and_window(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    """vLLM 0.33.0 stamps each BlockStored with its group's spec (kv_cache_manager.py:705-730)."""
    attn = {"num_kv_heads": 1, "head_size": 8, "dtype": "float32"}
    full = FullAttentionSpec(block_size=4, **attn)  # type: ignore[arg-type]
    window = SlidingWindowSpec(block_size=4, sliding_window=9, **attn)  # type: ignore[arg-type]
    kvm = make_manager(11, full, window, enable_kv_cache_events=True)
    assert kvm.allocate_slots(make_request("0", range(9)), 9) is not None
    stores = [e for e in kvm.take_events() if isinstance(e, BlockStored)]
    assert [
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stores
    ] == [
        (0, "full_attention", None),
        (1, "sliding_window", 9),
    ]
    # Fields paged has no source for stay unset.
    assert {(e.locality, e.ownership, e.session_id, e.lookahead_token_ids) for e in stores} == {
        (None, None, None, None)
    }


def test_spec_kinds_are_vllms_names() -> None:
    """kv_cache_interface.py:183-193 and 1421-1470: subclasses keep their own kind."""
    attn = {"num_kv_heads": 1, "head_size": 8, "dtype": "float32"}
    specs: list[tuple[KVCacheSpec, str, int | None]] = [
        (FullAttentionSpec(block_size=4, **attn), "full_attention", None),  # type: ignore[arg-type]
        # A sliding layer managed as full attention keeps every block: no window published.
        (FullAttentionSpec(block_size=4, sliding_window=8, **attn), "full_attention", None),  # type: ignore[arg-type]
        (MLAAttentionSpec(block_size=4, **attn), "mla_attention", None),  # type: ignore[arg-type]
        (SinkFullAttentionSpec(block_size=4, sink_len=4, **attn), "sink_full_attention", None),  # type: ignore[arg-type]
        (SlidingWindowSpec(block_size=4, sliding_window=8, **attn), "sliding_window", 8),  # type: ignore[arg-type]
        (
            ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **attn),  # type: ignore[arg-type]
            "chunked_local_attention",
            None,
        ),
        (CrossAttentionSpec(block_size=4, **attn), "cross_attention", None),  # type: ignore[arg-type]
        (MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float32",)), "mamba", None),
    ]
    for spec, kind, window in specs:
        assert (kv_cache_spec_kind(spec), kv_cache_spec_sliding_window(spec)) == (kind, window)
