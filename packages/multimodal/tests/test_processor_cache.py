"""Processor caches: P0 and P1 stay in step, a hit sends no tensor, shm round-trips."""

from __future__ import annotations

from multiprocessing import shared_memory

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from paged.multimodal.processor_cache import (
    ByteLRU,
    LRUSenderCache,
    MirrorReceiverCache,
    ProcessorCacheError,
    ProcessorOnlySenderCache,
    ReceiverCache,
    SenderCache,
    ShmSenderCache,
    make_receiver_cache,
    make_sender_cache,
    shm_segment_name,
)


def item(key: int, size: int) -> MultiModalFeatureSpec:
    data = {"pixel_values": TensorData("|u1", [size], bytes([key % 256]) * size)}
    return MultiModalFeatureSpec("image", f"h{key}", PlaceholderRange(0, 4), data)


def no_reprocess(index: int) -> dict[str, TensorData]:
    raise AssertionError(f"item {index} should not need re-processing")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=4), min_size=1, max_size=30),
    st.integers(0, 120),
)
def test_lru_sender_and_mirror_evict_alike(requests: list[list[int]], capacity: int) -> None:
    sizes = {k: 10 + 7 * k for k in range(10)}  # 10..73 bytes: some fit, some never do
    p0, p1 = LRUSenderCache(capacity), MirrorReceiverCache(capacity)
    for keys in requests:
        # P0 looks while processing: items it believes cached come without data.
        features = [
            msgspec.structs.replace(item(k, sizes[k]), data=None)
            if p0.is_cached(f"h{k}")
            else item(k, sizes[k])
            for k in keys
        ]

        def again(i: int, ks: list[int] = keys) -> dict[str, TensorData]:
            return item(ks[i], sizes[ks[i]]).data or {}

        sent = p0.commit(features, again)
        restored = p1.fill(sent)  # never raises: the mirror holds every hit
        assert restored == [item(k, sizes[k]) for k in keys]
        assert p0.lru.keys() == p1.lru.keys()
        p0.lru.check_integrity()
        p1.lru.check_integrity()


def test_a_hit_sends_no_tensor_and_counts() -> None:
    p0, p1 = LRUSenderCache(1000), MirrorReceiverCache(1000)
    first = p0.commit([item(1, 100)], no_reprocess)
    assert first[0].data is not None
    p1.fill(first)
    assert p0.is_cached("h1")
    second = p0.commit([msgspec.structs.replace(item(1, 100), data=None)], no_reprocess)
    assert second[0].data is None
    assert p1.fill(second)[0].data == item(1, 100).data
    assert p0.hit_rate() == (1, 2)
    with pytest.raises(ProcessorCacheError, match=r"mm_features\[0\].*out of step"):
        MirrorReceiverCache(1000).fill(second)
    with pytest.raises(ProcessorCacheError, match="keeps no processor cache"):
        ReceiverCache().fill(second)


def test_commit_reprocesses_a_hit_evicted_meanwhile() -> None:
    p0 = LRUSenderCache(150)
    p0.commit([item(1, 100)], no_reprocess)
    assert p0.is_cached("h1")  # request A processed believing h1 cached ...
    p0.commit([item(2, 100)], no_reprocess)  # ... then B's commit evicted it
    calls: list[int] = []

    def again(i: int) -> dict[str, TensorData]:
        calls.append(i)
        return item(1, 100).data or {}

    sent = p0.commit([msgspec.structs.replace(item(1, 100), data=None)], again)
    assert calls == [0] and sent[0].data == item(1, 100).data


def test_processor_only_keeps_tensors_in_p0_and_always_sends_them() -> None:
    p0 = ProcessorOnlySenderCache(1000)
    p0.commit([item(3, 50)], no_reprocess)
    assert p0.cached_data("h3") == item(3, 50).data
    sent = p0.commit([msgspec.structs.replace(item(3, 50), data=None)], no_reprocess)
    assert sent[0].data == item(3, 50).data
    assert p0.hit_rate() == (1, 2)


def test_none_mode_keeps_nothing() -> None:
    p0 = make_sender_cache("lru", 0)
    assert type(p0) is SenderCache and not p0.is_cached("h1")
    assert p0.commit([item(1, 10)], no_reprocess)[0].data is not None
    with pytest.raises(ValueError, match="mm_processor_cache_type must be one of"):
        make_sender_cache("fifo", 1)
    with pytest.raises(ValueError, match="mm_processor_cache_gb must be >= 0"):
        make_sender_cache("lru", -1)
    with pytest.raises(ValueError, match="shm_prefix"):
        make_receiver_cache("shm", 1)


def test_shm_round_trip_eviction_unlinks_and_close_cleans_up() -> None:
    p0 = ShmSenderCache(300)
    p1 = make_receiver_cache("shm", 1, shm_prefix=p0.prefix)
    try:
        sent = p0.commit([item(1, 100), item(1, 100)], no_reprocess)
        assert [f.data for f in sent] == [None, None]
        assert p1.fill(sent) == [item(1, 100), item(1, 100)]
        p0.commit([item(2, 100), item(3, 100)], no_reprocess)  # evicts h1 (LRU, bytes)
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=shm_segment_name(p0.prefix, "h1"))
        with pytest.raises(ProcessorCacheError, match="evicted from shared memory"):
            p1.fill(sent)
        big = p0.commit([item(4, 1000)], no_reprocess)  # larger than the cache: inline
        assert big[0].data is not None
    finally:
        p0.close()
    for key in ("h2", "h3"):
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=shm_segment_name(p0.prefix, key))


def test_byte_lru_never_stores_what_cannot_fit() -> None:
    lru: ByteLRU[int] = ByteLRU(10)
    assert lru.put("a", 1, 11) == [] and "a" not in lru
    lru.put("b", 2, 6)
    assert lru.put("c", 3, 6) == [("b", 2)]
    lru.check_integrity()


def _read_in_child(prefix: str, sent: list[MultiModalFeatureSpec]) -> bytes:
    restored = make_receiver_cache("shm", 1, shm_prefix=prefix).fill(sent)
    data = restored[0].data
    assert data is not None
    return data["pixel_values"].data


def test_shm_segments_are_read_by_another_process_and_survive_its_exit() -> None:
    import multiprocessing

    p0 = ShmSenderCache(1000)
    try:
        sent = p0.commit([item(5, 100)], no_reprocess)
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            assert pool.apply(_read_in_child, (p0.prefix, sent)) == bytes([5]) * 100
        # The reader's exit (and its resource tracker) left P0's segment alone.
        segment = shared_memory.SharedMemory(name=shm_segment_name(p0.prefix, "h5"))
        segment.close()
        assert make_receiver_cache("shm", 1, shm_prefix=p0.prefix).fill(sent)[0] == item(5, 100)
    finally:
        p0.close()
