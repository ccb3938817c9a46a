"""`ArcTierIndex`: a tier index evicting by ARC (vLLM 0.33's `eviction_policy: "arc"`).

Adaptive Replacement Cache, as vLLM 0.33's ARCCachePolicy
(v1/kv_offload/cpu/policies/arc.py) applies it to offloaded chunks:

    T1  chunks stored and not reused since        B1  keys recently evicted from T1
    T2  chunks reused (a lookup hit or a re-save)  B2  keys recently evicted from T2

A new chunk enters T1; a reuse moves it to T2 (or to T2's recent end). To make
room, T1's oldest chunk goes when T1 holds at least `target_t1` chunks, else
T2's oldest. Storing a key found in B1 (evicted too early from T1) raises
`target_t1`, one found in B2 lowers it, by the ghost lists' size ratio (at least
one). Each ghost list keeps at most as many keys as the tier holds chunks.

paged differs in one point: a reuse is counted when the scheduler looks a chunk
up (or a request saves it again), not when the request finishes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from paged.connectors.kv.offloading.chunks import ChunkKey
from paged.connectors.kv.offloading.index import InsertResult, TierIndex


class ArcTierIndex(TierIndex):
    """`TierIndex` (byte budget, same interface) whose evictions follow ARC."""

    def __init__(self, name: str, budget_bytes: int) -> None:
        super().__init__(name, budget_bytes)
        self.target_t1 = 0.0
        self._t1: OrderedDict[ChunkKey, None] = OrderedDict()
        self._t2: OrderedDict[ChunkKey, None] = OrderedDict()
        self._b1: OrderedDict[ChunkKey, None] = OrderedDict()
        self._b2: OrderedDict[ChunkKey, None] = OrderedDict()

    def keys_lru_first(self) -> list[ChunkKey]:
        """T1 then T2, each oldest first: the order evictions would take them in."""
        return [*self._t1, *self._t2]

    def recent_keys(self) -> list[ChunkKey]:
        return list(self._t1)

    def frequent_keys(self) -> list[ChunkKey]:
        return list(self._t2)

    def touch(self, key: ChunkKey) -> None:
        """A reuse: T1 -> T2, or T2's most recent end."""
        if key not in self._entries:
            return
        self._t1.pop(key, None)
        self._t2[key] = None
        self._t2.move_to_end(key)

    def insert(self, key: ChunkKey, nbytes: int) -> InsertResult:
        if key in self._entries:
            self.touch(key)
            return InsertResult(True, [])
        if nbytes > self.budget_bytes:
            return InsertResult(False, [])
        self._adapt(key)
        evicted: list[ChunkKey] = []
        while self.used_bytes + nbytes > self.budget_bytes:
            evicted.append(self._evict_one())
        self._trim_ghosts()
        self.num_evictions += len(evicted)
        self._entries[key] = nbytes
        self.used_bytes += nbytes
        self._t1[key] = None
        self._b1.pop(key, None)
        self._b2.pop(key, None)
        return InsertResult(True, evicted)

    def remove(self, key: ChunkKey) -> bool:
        if not super().remove(key):
            return False
        self._t1.pop(key, None)
        self._t2.pop(key, None)
        return True

    def rebuild(self, entries: Iterable[tuple[ChunkKey, int]]) -> list[ChunkKey]:
        for part in (self._t1, self._t2, self._b1, self._b2):
            part.clear()
        self.target_t1 = 0.0
        return super().rebuild(entries)

    def _adapt(self, key: ChunkKey) -> None:
        capacity = max(len(self._entries), 1)
        if key in self._b1:
            delta = max(1.0, len(self._b2) / len(self._b1))
            self.target_t1 = min(self.target_t1 + delta, float(capacity))
        elif key in self._b2:
            delta = max(1.0, len(self._b1) / len(self._b2))
            self.target_t1 = max(self.target_t1 - delta, 0.0)

    def _evict_one(self) -> ChunkKey:
        from_t1 = bool(self._t1) and (len(self._t1) >= int(self.target_t1) or not self._t2)
        if from_t1:
            key, _ = self._t1.popitem(last=False)
            self._b1[key] = None
        else:
            key, _ = self._t2.popitem(last=False)
            self._b2[key] = None
        self.used_bytes -= self._entries.pop(key)
        return key

    def _trim_ghosts(self) -> None:
        capacity = max(len(self._entries), 1)
        for ghost in (self._b1, self._b2):
            while len(ghost) > capacity:
                ghost.popitem(last=False)
