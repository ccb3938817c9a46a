"""Conformance with vLLM v1's EncoderCacheManager (the scenarios of vLLM's own tests).

Slots are counted in encoder embeddings; entries are shared by mm hash and
reference-counted by request id; an unreferenced entry stays cached (freeable)
until space is needed, then the oldest is evicted and its hash reported once.
"""

from __future__ import annotations

from paged.multimodal.encoder_cache import EncoderCacheManager
from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange


class MockRequest:
    def __init__(self, request_id: str, mm_hashes: list[str], token_counts: list[int]) -> None:
        self.request_id = request_id
        self._token_counts = token_counts
        self.mm_features = [
            MultiModalFeatureSpec(
                modality="image",
                identifier=h,
                mm_position=PlaceholderRange(offset=0, length=token_counts[i]),
            )
            for i, h in enumerate(mm_hashes)
        ]

    def get_num_encoder_embeds(self, input_id: int) -> int:
        return self._token_counts[input_id]


BIG = 10**9


def test_basic_allocate_and_reuse() -> None:
    cache = EncoderCacheManager(cache_size=10)
    req = MockRequest("r1", ["imgA"], [4])
    assert not cache.check_and_update_cache(req, 0)
    assert cache.can_allocate(req, 0, BIG, 0)
    cache.allocate(req, 0)
    assert cache.check_and_update_cache(req, 0)
    assert "r1" in cache.cached["imgA"] and cache.num_free_slots == 6
    cache.free_encoder_input(req, 0)
    cache.free_encoder_input(req, 0)  # a second free is a no-op
    assert not cache.cached["imgA"] and "imgA" in cache.freeable
    assert cache.num_freeable_slots == 10 and cache.num_free_slots == 6


def test_freeing_moves_to_freeable() -> None:
    cache = EncoderCacheManager(cache_size=10)
    req = MockRequest("req2", ["img3"], [5])
    assert cache.can_allocate(req, 0, BIG, 0)
    cache.allocate(req, 0)
    assert len(cache.cached["img3"]) == 1
    cache.free_encoder_input(req, 0)
    assert not cache.cached["img3"] and "img3" in cache.freeable
    assert cache.num_freeable_slots == 10


def test_free_request_frees_all_inputs() -> None:
    cache = EncoderCacheManager(cache_size=10)
    req = MockRequest("req3", ["a", "b"], [2, 3])
    for i in (0, 1):
        assert cache.can_allocate(req, i, BIG, 0)
        cache.allocate(req, i)
    cache.free(req)
    assert not cache.cached["a"] and not cache.cached["b"]
    assert "a" in cache.freeable and "b" in cache.freeable
    assert cache.num_freeable_slots == 10


def test_eviction_when_cache_is_full() -> None:
    cache = EncoderCacheManager(cache_size=10)
    req1 = MockRequest("req1", ["x"], [6])
    req2 = MockRequest("req2", ["y"], [5])
    assert cache.can_allocate(req1, 0, BIG, 0)
    cache.allocate(req1, 0)
    cache.free_encoder_input(req1, 0)
    assert cache.can_allocate(req2, 0, BIG, 0)
    cache.allocate(req2, 0)
    assert "x" not in cache.cached
    assert "x" in cache.get_freed_mm_hashes()


def test_get_cached_input_ids() -> None:
    cache = EncoderCacheManager(cache_size=10)
    req = MockRequest("reqX", ["m", "n", "o"], [2, 4, 3])
    for i in (0, 2):
        assert cache.can_allocate(req, i, BIG, 0)
        cache.allocate(req, i)
    assert cache.get_cached_input_ids(req) == {0, 2}


def test_hit_restores_from_freeable() -> None:
    cache = EncoderCacheManager(cache_size=10)
    req = MockRequest("reqY", ["imgZ"], [4])
    assert cache.can_allocate(req, 0, BIG, 0)
    cache.allocate(req, 0)
    cache.free_encoder_input(req, 0)
    assert cache.check_and_update_cache(req, 0)
    assert len(cache.cached["imgZ"]) == 1 and "imgZ" not in cache.freeable
    assert cache.num_freeable_slots == 6


def test_get_freed_mm_hashes_clears_the_list() -> None:
    cache = EncoderCacheManager(cache_size=10)
    req1 = MockRequest("reqA", ["a"], [5])
    req2 = MockRequest("reqB", ["b"], [6])
    assert cache.can_allocate(req1, 0, BIG, 0)
    cache.allocate(req1, 0)
    cache.free_encoder_input(req1, 0)
    assert cache.can_allocate(req2, 0, BIG, 0)
    cache.allocate(req2, 0)
    assert "a" in cache.get_freed_mm_hashes()
    assert cache.get_freed_mm_hashes() == []


def test_multi_images_respect_space_and_compute_limits() -> None:
    cache = EncoderCacheManager(cache_size=10)
    req = MockRequest("reqA", ["a", "b"], [5, 6])
    budget, scheduled = 100, 0
    assert cache.can_allocate(req, 0, budget, scheduled)
    scheduled += req.get_num_encoder_embeds(0)
    budget -= req.get_num_encoder_embeds(0)
    # Space: 5 scheduled + 6 > 10 slots.
    assert not cache.can_allocate(req, 1, budget, scheduled)

    cache = EncoderCacheManager(cache_size=100)
    budget, scheduled = 10, 0
    assert cache.can_allocate(req, 0, budget, scheduled)
    scheduled += req.get_num_encoder_embeds(0)
    budget -= req.get_num_encoder_embeds(0)
    # Compute: 6 > 5 left of the budget.
    assert not cache.can_allocate(req, 1, budget, scheduled)


def test_is_embed_mask_counts_only_embedding_positions() -> None:
    mask = [False] * 100
    for i in (5, 15, 25, 35, 45, 55, 65, 75):
        mask[i] = True
    req = MockRequest("r1", ["img1"], [100])
    req.mm_features[0] = MultiModalFeatureSpec(
        modality="image",
        identifier="img1",
        mm_position=PlaceholderRange(offset=0, length=100, is_embed=mask),
    )
    cache = EncoderCacheManager(cache_size=100)
    cache.allocate(req, 0)
    assert cache.num_free_slots == 92 and "img1" in cache.cached
    assert req.mm_features[0].mm_position.get_num_embeds() == 8
