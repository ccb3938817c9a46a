"""Per-tier counters of the offloading connector, as flat deltas for the metrics path.

Keys are `"{tier}.{counter}"` (tier: host, disk, redis; the Redis tier also
reports its faults as `"redis.{op}_{reason}"`, see redis_tier.py); values are increments since
the last report, so the server adds them to Prometheus counters as they come.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

TIERS = ("host", "disk", "redis")
COUNTERS = (
    "queries",  # tokens looked up in the tier (beyond the device prefix-cache hit)
    "hits",  # tokens found (and loaded)
    "bytes_saved",
    "bytes_loaded",
    "seconds_saved",
    "seconds_loaded",
    "evictions",  # chunks
)


@dataclass
class TierStats:
    queries: int = 0
    hits: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0
    seconds_saved: float = 0.0
    seconds_loaded: float = 0.0
    evictions: int = 0


@dataclass
class OffloadingStats:
    host: TierStats = field(default_factory=TierStats)
    disk: TierStats = field(default_factory=TierStats)
    redis: TierStats = field(default_factory=TierStats)
    load_errors: int = 0  # chunks

    def to_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for tier in TIERS:
            stats: TierStats = getattr(self, tier)
            for f in fields(stats):
                value = getattr(stats, f.name)
                if value:
                    out[f"{tier}.{f.name}"] = float(value)
        if self.load_errors:
            out["load_errors"] = float(self.load_errors)
        return out

    def add(self, deltas: dict[str, float]) -> None:
        """Add flat deltas (from the worker side) into these counters."""
        for name, value in deltas.items():
            if name == "load_errors":
                self.load_errors += int(value)
                continue
            tier, _, counter = name.partition(".")
            stats: TierStats = getattr(self, tier)
            current = getattr(stats, counter)
            setattr(stats, counter, type(current)(current + value))
