"""PreallocatedEncoderCache (vLLM's gap 4): a fixed buffer with an allocator.

Property tests: after any sequence of allocations and frees the runs are
disjoint and inside the buffer, used + free == capacity, every live item
still reads back exactly what was written (compaction moved it intact), and
an allocation succeeds exactly when enough rows are free. Driven by the
scheduler's EncoderCacheManager (allocate / evict -> freed hashes), the
worker's buffer never runs out: the two count the same capacity.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.multimodal.encoder_cache import EncoderCacheManager
from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from paged.runner.encoder_cache_buffer import EncoderCacheFullError, PreallocatedEncoderCache

HIDDEN = 3


def _cache(capacity: int) -> PreallocatedEncoderCache:
    return PreallocatedEncoderCache(capacity, HIDDEN, torch.float32, torch.device("cpu"))


def _content(key: int, n: int) -> torch.Tensor:
    """Rows unique to one item: row r of item k holds k * 1000 + r."""
    return (torch.arange(n, dtype=torch.float32) + key * 1000).unsqueeze(1).expand(n, HIDDEN)


# An op: ("alloc", size) or ("free", index into the live items).
ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 12)),
        st.tuples(st.just("free"), st.integers(0, 30)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 40), script=ops)
def test_allocator_invariants_hold_after_every_operation(
    capacity: int, script: list[tuple[str, int]]
) -> None:
    cache = _cache(capacity)
    live: dict[str, tuple[int, int]] = {}  # mm hash -> (key, size)
    next_key = 0
    for op, arg in script:
        if op == "alloc":
            mm_hash = f"h{next_key}"
            fits = arg <= cache.num_free
            if fits:
                cache.allocate(mm_hash, arg).copy_(_content(next_key, arg))
                live[mm_hash] = (next_key, arg)
            else:
                with pytest.raises(EncoderCacheFullError):
                    cache.allocate(mm_hash, arg)
            next_key += 1
        elif live:
            victim = sorted(live)[arg % len(live)]
            cache.free(victim)
            del live[victim]
        cache.check_integrity()
        assert cache.num_used + cache.num_free == cache.capacity
        assert cache.num_used == sum(size for _, size in live.values())
        assert set(cache) == set(live)
        for mm_hash, (key, size) in live.items():
            rows = cache.get(mm_hash)
            assert rows is not None and rows.shape == (size, HIDDEN)
            assert torch.equal(rows, _content(key, size)), mm_hash


def test_fragmentation_is_compacted_and_contents_survive() -> None:
    cache = _cache(12)
    for key, (name, size) in enumerate([("a", 2), ("b", 2), ("c", 3), ("d", 2), ("e", 3)]):
        cache.allocate(name, size).copy_(_content(key, size))
    cache.free("b")
    cache.free("d")  # free rows: [2, 4) and [7, 9): 4 rows, no hole of 4
    assert cache.num_compactions == 0
    cache.allocate("f", 4).copy_(_content(9, 4))
    assert cache.num_compactions == 1
    assert cache.run_of("a") == (0, 2) and cache.run_of("c") == (2, 3)
    assert cache.run_of("e") == (5, 3) and cache.run_of("f") == (8, 4)
    for key, name, size in [(0, "a", 2), (2, "c", 3), (4, "e", 3), (9, "f", 4)]:
        rows = cache.get(name)
        assert rows is not None and torch.equal(rows, _content(key, size))
    cache.check_integrity()


def test_views_are_rows_of_the_one_buffer() -> None:
    cache = _cache(8)
    rows = cache.allocate("x", 3)
    base = cache.buffer.data_ptr()
    assert base <= rows.data_ptr() < base + cache.buffer.numel() * cache.buffer.element_size()
    rows.fill_(7.0)
    assert torch.equal(cache.buffer[:3], torch.full((3, HIDDEN), 7.0))


def test_bad_calls_are_rejected() -> None:
    cache = _cache(4)
    cache.allocate("x", 2)
    with pytest.raises(ValueError, match="already"):
        cache.allocate("x", 1)
    with pytest.raises(ValueError, match="num_embeds"):
        cache.allocate("y", 0)
    with pytest.raises(ValueError, match="shape"):
        cache.store("z", torch.zeros(2, HIDDEN + 1))
    with pytest.raises(ValueError, match="capacity"):
        _cache(0)
    cache.free("never-there")  # a hash the worker never held: no-op
    cache.check_integrity()


class _Item:
    """A request with one item, the shape EncoderCacheManager needs."""

    def __init__(self, rid: str, mm_hash: str, size: int) -> None:
        self.request_id = rid
        self.mm_features = [MultiModalFeatureSpec("image", mm_hash, PlaceholderRange(0, size))]


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(4, 40),
    script=st.lists(st.tuples(st.integers(0, 15), st.integers(1, 10), st.booleans()), max_size=60),
)
def test_worker_buffer_mirrors_the_scheduler_manager(
    capacity: int, script: list[tuple[int, int, bool]]
) -> None:
    """Whatever the scheduler admits, the worker can hold (and frees what it evicts)."""
    manager = EncoderCacheManager(capacity)
    cache = _cache(capacity)
    sizes: dict[str, int] = {}
    for step, (image, size, finish) in enumerate(script):
        mm_hash = f"img{image}"
        size = sizes.setdefault(mm_hash, min(size, capacity))
        request = _Item(f"r{step}", mm_hash, size)
        if manager.check_and_update_cache(request, 0):
            assert mm_hash in cache  # a hit in the scheduler is a hit in the worker
        elif manager.can_allocate(request, 0, capacity, 0):
            manager.allocate(request, 0)
            # The worker sees the evictions first (free_encoder_mm_hashes), then encodes.
            for freed in manager.get_freed_mm_hashes():
                cache.free(freed)
            cache.store(mm_hash, _content(image, size))
        if finish:
            manager.free(request)
        manager.check_integrity()
        cache.check_integrity()
        assert set(cache) == set(manager.cached)
