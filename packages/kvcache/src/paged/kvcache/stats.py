"""Prefix-cache statistics, in tokens (converted by the scheduler to its boundary type)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last `make_prefix_cache_stats()`.

    `queries` counts looked-up tokens (each request's `num_tokens`), `hits`
    the tokens served from the cache; `reset` is True if the cache was reset
    in between. Preempted requests are counted separately, as their second
    lookup is not a new query.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool = False) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
