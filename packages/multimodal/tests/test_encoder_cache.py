"""EncoderCacheManager: sharing, lazy FIFO eviction, budgets, accounting invariant."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.multimodal.encoder_cache import (
    EncoderBudget,
    EncoderCacheManager,
    compute_mm_encoder_budget,
)
from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange


@dataclass
class FakeRequest:
    request_id: str
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)


def item(mm_hash: str, length: int, offset: int = 0) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        modality="image", identifier=mm_hash, mm_position=PlaceholderRange(offset, length)
    )


def test_miss_allocate_then_shared_hit() -> None:
    m = EncoderCacheManager(cache_size=10)
    a = FakeRequest("a", [item("img", 4)])
    b = FakeRequest("b", [item("img", 4)])
    assert not m.check_and_update_cache(a, 0)
    assert m.can_allocate(a, 0, encoder_compute_budget=10, num_embeds_to_schedule=0)
    m.allocate(a, 0)
    assert m.num_free_slots == 6
    assert m.check_and_update_cache(b, 0)
    assert m.cached["img"] == {"a", "b"}
    m.free(a)
    assert "img" not in m.freeable  # b still references it
    m.free(b)
    assert m.freeable == {"img": 4}
    assert m.num_free_slots == 6 and m.num_freeable_slots == 10
    m.check_integrity()


def test_freeable_entry_revived_by_hit() -> None:
    m = EncoderCacheManager(cache_size=10)
    a = FakeRequest("a", [item("img", 4)])
    m.allocate(a, 0)
    m.free(a)
    c = FakeRequest("c", [item("img", 4)])
    assert m.check_and_update_cache(c, 0)
    assert m.freeable == {}
    assert m.num_freeable_slots == 6
    m.check_integrity()


def test_lazy_fifo_eviction_oldest_first() -> None:
    m = EncoderCacheManager(cache_size=10)
    reqs = [FakeRequest(f"r{i}", [item(f"h{i}", 3)]) for i in range(3)]
    for r in reqs:
        assert m.can_allocate(r, 0, 100, 0)
        m.allocate(r, 0)
    for r in (reqs[1], reqs[0], reqs[2]):  # freeable order: h1, h0, h2
        m.free(r)
    assert m.get_freed_mm_hashes() == []  # nothing evicted eagerly
    big = FakeRequest("big", [item("big", 7)])
    assert m.can_allocate(big, 0, 100, 0)
    # 1 free slot; needs 7 -> evicts h1 (->4) then h0 (->7); h2 survives.
    assert m.get_freed_mm_hashes() == ["h1", "h0"]
    assert m.get_freed_mm_hashes() == []
    assert "h2" in m.cached
    m.allocate(big, 0)
    m.check_integrity()


def test_can_allocate_refuses_over_budget_or_unreclaimable() -> None:
    m = EncoderCacheManager(cache_size=10)
    r = FakeRequest("r", [item("x", 6)])
    assert not m.can_allocate(r, 0, encoder_compute_budget=5, num_embeds_to_schedule=0)
    held = FakeRequest("held", [item("y", 6)])
    m.allocate(held, 0)
    # 4 free, nothing freeable: no eviction, refusal, state unchanged
    assert not m.can_allocate(r, 0, 100, 0)
    assert m.freed == [] and m.num_free_slots == 4
    # already-chosen embeddings of this step count against the space
    small = FakeRequest("s", [item("z", 2)])
    assert not m.can_allocate(small, 0, 100, num_embeds_to_schedule=3)
    m.check_integrity()


def test_allocate_without_room_raises() -> None:
    m = EncoderCacheManager(cache_size=2)
    with pytest.raises(RuntimeError, match="can_allocate"):
        m.allocate(FakeRequest("r", [item("x", 3)]), 0)


def test_is_embed_counts_only_embedding_positions() -> None:
    m = EncoderCacheManager(cache_size=10)
    spec = MultiModalFeatureSpec(
        modality="image",
        identifier="e",
        mm_position=PlaceholderRange(0, 4, is_embed=[True, False, True, False]),
    )
    r = FakeRequest("r", [spec])
    m.allocate(r, 0)
    assert m.num_free_slots == 8


def test_free_unknown_is_noop_and_reset_evicts_all() -> None:
    m = EncoderCacheManager(cache_size=5)
    r = FakeRequest("r", [item("x", 2)])
    m.free_encoder_input(r, 0)
    m.allocate(r, 0)
    m.free_encoder_input(FakeRequest("other", [item("x", 2)]), 0)
    assert m.cached["x"] == {"r"}
    m.reset()
    assert m.get_freed_mm_hashes() == ["x"]
    assert m.num_free_slots == 5
    m.check_integrity()


def test_negative_cache_size_rejected() -> None:
    with pytest.raises(ValueError, match="cache_size"):
        EncoderCacheManager(-1)


def test_compute_budget_guarantees_one_item() -> None:
    assert compute_mm_encoder_budget(100, 200, 500) == EncoderBudget(500, 500)
    assert compute_mm_encoder_budget(1000, 2000, 500) == EncoderBudget(1000, 2000)
    assert compute_mm_encoder_budget(1000, 2000, 0) == EncoderBudget(0, 0)
    with pytest.raises(ValueError, match="encoder_cache_size"):
        compute_mm_encoder_budget(1, -1, 1)


ops = st.lists(
    st.tuples(st.sampled_from(["use", "free", "free_req"]), st.integers(0, 5), st.integers(0, 5)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_ops_keep_invariant(operations: list[tuple[str, int, int]]) -> None:
    m = EncoderCacheManager(cache_size=12)
    sizes = {f"h{i}": 1 + (i * 3) % 7 for i in range(6)}
    reqs = {f"r{j}": FakeRequest(f"r{j}", [item(h, s) for h, s in sizes.items()]) for j in range(6)}
    evicted: set[str] = set()
    for op, rj, hi in operations:
        req = reqs[f"r{rj}"]
        if op == "use":
            if not m.check_and_update_cache(req, hi) and m.can_allocate(req, hi, 100, 0):
                m.allocate(req, hi)
        elif op == "free":
            m.free_encoder_input(req, hi)
        else:
            m.free(req)
        freed = m.get_freed_mm_hashes()
        # Only unreferenced entries are ever evicted.
        for h in freed:
            assert h not in m.cached
        evicted.update(freed)
        m.check_integrity()
    for req in reqs.values():
        m.free(req)
    m.check_integrity()
    assert m.num_freeable_slots == m.cache_size
