"""Scheduler-side bookkeeping of the encoder cache (seed: EncoderCache, バックエンド MM処理パス §1).

The worker holds the real tensors (`encoder_cache: dict[mm_hash, Tensor]`);
this manager only counts *embedding slots* so the scheduler knows what fits.
Entries are shared across requests by `mm_hash` and reference-counted by
request id. An entry whose last reference goes away is not freed at once: it
becomes *freeable* and stays usable (a later request with the same image hits
it) until space is needed, then it is evicted oldest-first (lazy FIFO). Evicted
hashes are handed to the worker through `get_freed_mm_hashes()`.

Slot accounting invariant (checked by `check_integrity()`):

    num_free_slots     = cache_size - sum(size of every entry in `cached`)
    num_freeable_slots = num_free_slots + sum(size of every freeable entry)

so `num_free_slots <= num_freeable_slots <= cache_size` always holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from paged.multimodal.inputs import MultiModalFeatureSpec


class EncoderCacheRequest(Protocol):
    """The view of a request the encoder cache needs (the scheduler's Request satisfies it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def mm_features(self) -> Sequence[MultiModalFeatureSpec]: ...


def num_encoder_embeds(request: EncoderCacheRequest, input_id: int) -> int:
    """Encoder embeddings item `input_id` of `request` occupies in the cache."""
    return request.mm_features[input_id].mm_position.get_num_embeds()


class EncoderCacheManager:
    """Reference-counted encoder-output slots with lazy FIFO eviction.

    `cache_size` is measured in encoder embeddings (not bytes, not prompt
    tokens: break tokens inside a placeholder that receive no embedding do not
    count). Callers follow the protocol of the seed:
    `check_and_update_cache` (hit? then reference it) -> on miss `can_allocate`
    (may evict) -> `allocate`; `free_encoder_input` / `free` drop references.
    """

    def __init__(self, cache_size: int) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        # mm_hash -> ids of the requests that reference it (empty set = freeable).
        self.cached: dict[str, set[str]] = {}
        # mm_hash -> its size in embeddings; insertion order is eviction order (oldest first).
        self.freeable: OrderedDict[str, int] = OrderedDict()
        # Evicted since the last get_freed_mm_hashes(); the worker pops them.
        self.freed: list[str] = []
        # mm_hash -> size, for every entry in `cached` (integrity checks, eviction).
        self._sizes: dict[str, int] = {}

    def check_and_update_cache(self, request: EncoderCacheRequest, input_id: int) -> bool:
        """True if item `input_id`'s output is cached; then `request` now references it."""
        mm_hash = request.mm_features[input_id].identifier
        refs = self.cached.get(mm_hash)
        if refs is None:
            return False
        if not refs:
            # Revive a freeable entry: its slots are no longer reclaimable.
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        refs.add(request.request_id)
        return True

    def can_allocate(
        self,
        request: EncoderCacheRequest,
        input_id: int,
        encoder_compute_budget: int,
        num_embeds_to_schedule: int,
    ) -> bool:
        """Whether item `input_id` fits this step, evicting freeable entries if needed.

        `encoder_compute_budget` is what is left of this step's encoder budget;
        `num_embeds_to_schedule` counts embeddings already chosen this step but
        not yet allocated. Eviction happens here (bookkeeping only: the worker
        frees memory after it sees the hashes in `get_freed_mm_hashes()`).
        """
        num_embeds = num_encoder_embeds(request, input_id)
        if num_embeds > encoder_compute_budget:
            return False
        needed = num_embeds + num_embeds_to_schedule
        if needed <= self.num_free_slots:
            return True
        if needed > self.num_freeable_slots:
            return False
        while needed > self.num_free_slots:
            mm_hash, size = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            del self._sizes[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += size
        return True

    def allocate(self, request: EncoderCacheRequest, input_id: int) -> None:
        """Reserve slots for item `input_id` of `request` (after `can_allocate` said yes)."""
        mm_hash = request.mm_features[input_id].identifier
        size = num_encoder_embeds(request, input_id)
        refs = self.cached.get(mm_hash)
        if refs is not None:
            # Another request of this step already allocated the same item: share it.
            if not refs:
                self.num_freeable_slots -= self.freeable.pop(mm_hash)
            refs.add(request.request_id)
            return
        if size > self.num_free_slots:
            raise RuntimeError(
                f"encoder cache overcommitted: item {mm_hash!r} needs {size} slots, "
                f"{self.num_free_slots} free (can_allocate must be called first)"
            )
        self.cached[mm_hash] = {request.request_id}
        self._sizes[mm_hash] = size
        self.num_free_slots -= size
        self.num_freeable_slots -= size

    def get_cached_input_ids(self, request: EncoderCacheRequest) -> set[int]:
        """Indices of `request`'s items whose output is in the cache (referenced or not)."""
        return {i for i, f in enumerate(request.mm_features) if f.identifier in self.cached}

    def free_encoder_input(self, request: EncoderCacheRequest, input_id: int) -> None:
        """Drop `request`'s reference to item `input_id`; the last reference makes it freeable."""
        mm_hash = request.mm_features[input_id].identifier
        refs = self.cached.get(mm_hash)
        if not refs or request.request_id not in refs:
            return
        refs.discard(request.request_id)
        if not refs:
            size = self._sizes[mm_hash]
            self.freeable[mm_hash] = size
            self.num_freeable_slots += size

    def free(self, request: EncoderCacheRequest) -> None:
        """Drop every reference `request` holds (it finished or was preempted)."""
        for input_id in self.get_cached_input_ids(request):
            self.free_encoder_input(request, input_id)

    def evict_unreferenced(self, mm_hash: str) -> bool:
        """Evict `mm_hash` now if no request references it; True if it was evicted.

        For an entry whose content never arrived (a failed encoder-cache load):
        keeping it would make later requests skip the encoder for it.
        """
        refs = self.cached.get(mm_hash)
        if refs is None or refs:
            return False
        size = self.freeable.pop(mm_hash)
        del self.cached[mm_hash]
        del self._sizes[mm_hash]
        self.freed.append(mm_hash)
        self.num_free_slots += size
        return True

    def get_freed_mm_hashes(self) -> list[str]:
        """Hashes evicted since the last call; the caller forwards them to the worker."""
        freed = self.freed
        self.freed = []
        return freed

    def reset(self) -> None:
        """Evict everything (e.g. after a weight update); referenced entries included."""
        self.freed.extend(self.cached)
        self.cached.clear()
        self.freeable.clear()
        self._sizes.clear()
        self.num_free_slots = self.cache_size
        self.num_freeable_slots = self.cache_size

    def check_integrity(self) -> None:
        """Raise AssertionError if the slot accounting invariant is broken."""
        used = sum(self._sizes.values())
        assert set(self._sizes) == set(self.cached), "sizes and cached disagree"
        assert self.num_free_slots == self.cache_size - used, "num_free_slots drifted"
        freeable_total = sum(self.freeable.values())
        assert self.num_freeable_slots == self.num_free_slots + freeable_total
        for mm_hash in self.freeable:
            assert self.cached.get(mm_hash) == set(), f"freeable {mm_hash!r} still referenced"
        for mm_hash, refs in self.cached.items():
            assert refs or mm_hash in self.freeable, f"unreferenced {mm_hash!r} not freeable"
        assert 0 <= self.num_free_slots <= self.num_freeable_slots <= self.cache_size


@dataclass(frozen=True, slots=True)
class EncoderBudget:
    """Per-step encoder compute budget and cache capacity, both in embeddings."""

    encoder_compute_budget: int
    encoder_cache_size: int


def compute_mm_encoder_budget(
    max_num_encoder_input_tokens: int,
    encoder_cache_size: int,
    max_tokens_per_mm_item: int,
) -> EncoderBudget:
    """Budgets that always let the largest single item through (seed formula).

    A model whose largest item needs more embeddings than the configured
    budget or cache would otherwise never run its encoder on that item, so
    both are raised to at least `max_tokens_per_mm_item`. A model without
    multimodal inputs (`max_tokens_per_mm_item == 0`) gets zero budgets.
    """
    for name, value in (
        ("max_num_encoder_input_tokens", max_num_encoder_input_tokens),
        ("encoder_cache_size", encoder_cache_size),
        ("max_tokens_per_mm_item", max_tokens_per_mm_item),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if max_tokens_per_mm_item == 0:
        return EncoderBudget(encoder_compute_budget=0, encoder_cache_size=0)
    return EncoderBudget(
        encoder_compute_budget=max(max_num_encoder_input_tokens, max_tokens_per_mm_item),
        encoder_cache_size=max(encoder_cache_size, max_tokens_per_mm_item),
    )
