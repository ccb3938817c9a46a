"""`EngineLoadBalancer`: which data-parallel engine gets the next request.

Each engine reports its own load with every output batch (the
`SchedulerStats` snapshot: waiting and running requests). Between two
reports the frontend counts the requests it sent that engine as waiting,
since the engine has not seen them yet when its last report was made (vLLM's
DP load-balancing client does the same). The score is vLLM's,
``4 * waiting + running``: a waiting request still has its whole prefill
ahead, so it weighs more than one already decoding.

The engine's report is capped by what the frontend knows exactly: the
requests it routed there that have not finished (`held`). An engine that
went idle after aborts sends no more reports, and without the cap its last
one would make it look busy forever.

The lightest live engine wins; ties go round robin (the scan starts one
engine further each time), so an idle cluster still alternates.

Not thread-safe: the asyncio client calls it from its event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.scheduler.boundary import SchedulerStats

WAITING_WEIGHT = 4  # vLLM's weight of a waiting request against a running one


@dataclass(slots=True)
class EngineLoad:
    """What the frontend knows of one engine's load."""

    reported_waiting: int = 0
    reported_running: int = 0
    sent_since_report: int = 0  # requests sent after the last report arrived
    held: int = 0  # routed here and not finished or aborted (known to the frontend)
    alive: bool = True

    @property
    def score(self) -> int:
        running = min(self.reported_running, self.held)
        waiting = min(self.reported_waiting + self.sent_since_report, self.held - running)
        return WAITING_WEIGHT * waiting + running


class EngineLoadBalancer:
    """Load of `num_engines` engines; picks the lightest live one."""

    def __init__(self, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.loads = [EngineLoad() for _ in range(num_engines)]
        self._next_start = 0

    @property
    def num_engines(self) -> int:
        return len(self.loads)

    def live_engines(self) -> list[int]:
        return [i for i, load in enumerate(self.loads) if load.alive]

    def choose(self) -> int | None:
        """The engine for the next request (counted as sent to it); None when all are dead."""
        n = len(self.loads)
        best: int | None = None
        for k in range(n):
            i = (self._next_start + k) % n
            load = self.loads[i]
            if load.alive and (best is None or load.score < self.loads[best].score):
                best = i
        self._next_start = (self._next_start + 1) % n
        if best is not None:
            self.loads[best].sent_since_report += 1
            self.loads[best].held += 1
        return best

    def release(self, engine_index: int, count: int = 1) -> None:
        """`count` requests routed to `engine_index` finished or were aborted."""
        load = self.loads[engine_index]
        load.held = max(0, load.held - count)

    def report(self, engine_index: int, stats: SchedulerStats) -> None:
        """Engine `engine_index`'s own counts (from its latest output batch)."""
        load = self.loads[engine_index]
        load.reported_waiting = stats.num_waiting_reqs
        load.reported_running = stats.num_running_reqs
        load.sent_since_report = 0

    def mark_dead(self, engine_index: int) -> None:
        """Never route to this engine again."""
        self.loads[engine_index].alive = False
