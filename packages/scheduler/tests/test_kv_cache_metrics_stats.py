"""A `KVCacheMetricsCollector` given to the scheduler reports through `SchedulerStats`."""

from __future__ import annotations

import itertools

import msgspec

from paged.kvcache import KVCacheMetricsCollector
from paged.scheduler.boundary import SchedulerStats
from paged.scheduler.testing import make_request, make_scheduler, run_to_completion


def test_eviction_events_ride_in_the_stats_once() -> None:
    ticks = itertools.count()
    collector = KVCacheMetricsCollector(sample_rate=1.0, clock=lambda: float(next(ticks)))
    sched = make_scheduler(num_blocks=4, kv_metrics_collector=collector)
    # 3 usable blocks of 4 tokens; each request needs all 3 (8 + 4 tokens), so
    # the second one reuses (evicts) every block the first one freed.
    sched.add_request(make_request("a", 8, max_tokens=4))
    run_to_completion(sched)
    assert sched.make_stats() == SchedulerStats(kv_cache_usage=0.0)  # nothing evicted yet
    sched.add_request(make_request("b", list(range(50, 58)), max_tokens=4))
    seen: list[SchedulerStats] = []
    run_to_completion(sched, on_step=lambda s, _: seen.append(s.make_stats() or SchedulerStats()))
    events = [e for s in seen for e in s.kv_cache_eviction_events]
    # Never touched after allocation: idle since birth.
    assert len(events) == 3 and all(e.lifetime_seconds == e.idle_seconds > 0 for e in events)
    assert sched.make_stats() == SchedulerStats(kv_cache_usage=0.0)  # drained: reported once
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(seen[0]), type=SchedulerStats)
    assert wire.kv_cache_eviction_events == seen[0].kv_cache_eviction_events


def test_without_a_collector_the_stats_carry_no_events() -> None:
    sched = make_scheduler(num_blocks=6)
    for rid, start in (("a", 1), ("b", 50)):
        sched.add_request(make_request(rid, list(range(start, start + 8)), max_tokens=4))
    run_to_completion(sched)
    stats = sched.make_stats()
    assert stats is not None and stats.kv_cache_eviction_events == []
