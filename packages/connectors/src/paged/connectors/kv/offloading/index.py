"""`TierIndex`: the scheduler side's record of what one tier holds (byte budget, LRU).

The scheduler side decides every insertion and eviction (as vLLM's
OffloadingManager does); the worker side only executes them, in order. So the
index is the truth about a tier's contents, up to chunks the worker failed to
write or found corrupt, which come back as load errors and are removed.

Order invariant: `_entries` runs from least to most recently used; a lookup
hit or an insertion moves a key to the most recent end; eviction pops from
the least recent end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from paged.connectors.kv.offloading.chunks import ChunkKey


class InsertResult(NamedTuple):
    """inserted: False when the chunk alone exceeds the budget (nothing evicted then)."""

    inserted: bool
    evicted: list[ChunkKey]


class TierIndex:
    """Keys -> bytes of one tier under a byte budget, least recently used evicted first."""

    def __init__(self, name: str, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"{name} tier budget must be positive, got {budget_bytes} bytes")
        self.name = name
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.num_evictions = 0
        self._entries: OrderedDict[ChunkKey, int] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys_lru_first(self) -> list[ChunkKey]:
        return list(self._entries)

    def touch(self, key: ChunkKey) -> None:
        """Mark `key` most recently used (a lookup hit)."""
        self._entries.move_to_end(key)

    def insert(self, key: ChunkKey, nbytes: int) -> InsertResult:
        """Add `key` (or touch it if present), evicting least recently used keys to fit."""
        if key in self._entries:
            self.touch(key)
            return InsertResult(True, [])
        if nbytes > self.budget_bytes:
            return InsertResult(False, [])
        evicted: list[ChunkKey] = []
        while self.used_bytes + nbytes > self.budget_bytes:
            old, size = self._entries.popitem(last=False)
            self.used_bytes -= size
            evicted.append(old)
        self.num_evictions += len(evicted)
        self._entries[key] = nbytes
        self.used_bytes += nbytes
        return InsertResult(True, evicted)

    def remove(self, key: ChunkKey) -> bool:
        """Forget `key` (its chunk was found corrupt or missing); False if absent."""
        size = self._entries.pop(key, None)
        if size is None:
            return False
        self.used_bytes -= size
        return True

    def rebuild(self, entries: Iterable[tuple[ChunkKey, int]]) -> list[ChunkKey]:
        """Replace the contents with `entries` (oldest first); returns keys over budget, evicted."""
        self._entries.clear()
        self.used_bytes = 0
        evicted: list[ChunkKey] = []
        for key, nbytes in entries:
            evicted.extend(self.insert(key, nbytes).evicted)
        self.num_evictions = 0  # start-up trimming is not an eviction under load
        return evicted

    def check_integrity(self) -> None:
        """`AssertionError` if the byte count or the budget is violated."""
        total = sum(self._entries.values())
        if total != self.used_bytes:
            raise AssertionError(f"{self.name}: used_bytes {self.used_bytes} != sum {total}")
        if self.used_bytes > self.budget_bytes:
            raise AssertionError(
                f"{self.name}: {self.used_bytes} bytes used over budget {self.budget_bytes}"
            )
