"""Sampled block residency metrics (lifetime, idle time, reuse gaps).

Tracking every block would cost a dict operation per allocation on the hottest
path, so a block is tracked only when a coin flip at allocation succeeds
(`sample_rate`, 1% by default). The collector is off unless one is passed to
`BlockPool` / `KVCacheManager`.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from paged.kvcache.block import KVCacheBlock

_MAX_ACCESS_HISTORY = 4


@dataclass(slots=True)
class BlockMetricsState:
    """Timestamps of one sampled block since its allocation."""

    birth_time: float
    last_access_time: float
    access_history: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_ACCESS_HISTORY))

    def reuse_gaps(self) -> tuple[float, ...]:
        hist = list(self.access_history)
        return tuple(b - a for a, b in itertools.pairwise(hist))


@dataclass(frozen=True, slots=True)
class KVCacheEvictionEvent:
    """Residency of one sampled block, reported when it is evicted."""

    block_id: int
    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple[float, ...]


class KVCacheMetricsCollector:
    """Collects `KVCacheEvictionEvent`s for a random sample of blocks."""

    def __init__(
        self,
        sample_rate: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self.block_metrics: dict[int, BlockMetricsState] = {}
        self._events: list[KVCacheEvictionEvent] = []

    def should_sample_block(self) -> bool:
        return self._rng.random() < self.sample_rate

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        if self.should_sample_block():
            now = self._clock()
            state = BlockMetricsState(birth_time=now, last_access_time=now)
            state.access_history.append(now)
            self.block_metrics[block.block_id] = state

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        state = self.block_metrics.get(block.block_id)
        if state is not None:
            now = self._clock()
            state.last_access_time = now
            state.access_history.append(now)

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        state = self.block_metrics.pop(block.block_id, None)
        if state is None:
            return
        now = self._clock()
        self._events.append(
            KVCacheEvictionEvent(
                block_id=block.block_id,
                lifetime_seconds=now - state.birth_time,
                idle_seconds=now - state.last_access_time,
                reuse_gaps_seconds=state.reuse_gaps(),
            )
        )

    def reset(self) -> None:
        """Forget all tracked blocks (prefix cache reset)."""
        self.block_metrics.clear()

    def drain_events(self) -> list[KVCacheEvictionEvent]:
        events, self._events = self._events, []
        return events
