"""`StoreAdmission`: vLLM 0.33's `store_threshold` filter for new chunks.

A chunk offered for storage (a request computed it) is counted; a chunk not in
any tier is stored only once its count reaches the threshold, so one-off
prompts never displace reused ones. As vLLM's CPUOffloadingManager
(v1/kv_offload/cpu/manager.py:125-150, 261-290): thresholds below 2 store
everything; the counts live in an LRU table of `max_tracker_size` keys whose
oldest entry makes room, but never a key of the offer being counted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from paged.connectors.kv.offloading.chunks import ChunkKey


class StoreAdmission:
    """Offer counts per chunk key, bounded; `admit` says whether a new chunk may be stored."""

    def __init__(self, threshold: int, max_tracked: int) -> None:
        self.threshold = threshold
        self.max_tracked = max_tracked
        self.skipped = 0  # new chunks refused, for the stats
        self._counts: OrderedDict[ChunkKey, int] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.threshold >= 2

    def __len__(self) -> int:
        return len(self._counts)

    def record(self, keys: Sequence[ChunkKey]) -> None:
        """Count one offer of each key (one request's newly computed chunks)."""
        if not self.enabled:
            return
        protected: set[ChunkKey] = set()
        for key in keys:
            if key in self._counts:
                self._counts.move_to_end(key)
                self._counts[key] += 1
                protected.add(key)
        evictable = len(self._counts) - len(protected)
        for key in keys:
            if key in self._counts:
                continue
            if len(self._counts) >= self.max_tracked:
                if evictable == 0:
                    continue  # the table holds only this offer's keys: the key goes uncounted
                self._counts.popitem(last=False)
                evictable -= 1
            self._counts[key] = 1

    def admit(self, key: ChunkKey) -> bool:
        """Whether a chunk held by no tier may be stored now (counts a refusal)."""
        if not self.enabled or self._counts.get(key, 0) >= self.threshold:
            return True
        self.skipped += 1
        return False
