"""Per-step timeline of the engine core process, for finding where served time goes.

Off unless `PAGED_STEP_TRACE=PATH` is set in the engine's environment. Then
`EngineCoreProc` records, for every step that produced outputs, when it
started, how long it took (wall and the loop thread's CPU), how long the loop
had been idle waiting for input before it, and the batch: tokens scheduled,
requests running / waiting, outputs and new tokens. The output thread adds
its encode time and the bytes it sent. At exit one JSON document is written
to PATH: a summary (pure-decode vs prefill-carrying steps, idle time, encode
cost) and the steps themselves.

Meant for benchmark runs: every step is kept in memory (~200 bytes each) until
exit; a trace that cannot be written is logged, never raised (the engine's
shutdown must go on).

A step is "pure decode" when every token it scheduled came back as a new
token (one per request); a prefill chunk schedules many tokens and returns
at most one. `running` / `waiting` are the scheduler's counts after the step.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from paged.scheduler.boundary import EngineCoreOutputs

logger = logging.getLogger(__name__)
ENV_VAR = "PAGED_STEP_TRACE"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as the busy loop saw it (times in seconds)."""

    start: float  # since the trace began
    wall: float
    cpu: float  # the loop thread's CPU time over the step
    idle_before: float  # blocked waiting for input right before this step
    scheduled_tokens: int
    running: int  # after the step (requests that finished in it are gone)
    waiting: int
    outputs: int
    new_tokens: int

    @property
    def pure_decode(self) -> bool:
        return self.scheduled_tokens == self.new_tokens


class StepTrace:
    """Collects `StepRecord`s and output-thread counters; thread-safe where it must be."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._t0 = time.monotonic()
        self._steps: list[StepRecord] = []
        self._lock = threading.Lock()  # the output thread's counters
        self._encode_s = 0.0
        self._bytes_sent = 0
        self._messages = 0
        self._idle_s = 0.0
        self._step_start = 0.0
        self._step_cpu = 0.0

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(ENV_VAR)
        return cls(path) if path else None

    # -- the busy loop -------------------------------------------------------------
    def add_idle(self, seconds: float) -> None:
        self._idle_s += seconds

    def begin_step(self) -> None:
        self._step_start = time.monotonic()
        self._step_cpu = time.thread_time()

    def end_step(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Record the step begun last; a step that produced nothing is not a step."""
        if not outputs:
            return
        wall = time.monotonic() - self._step_start
        cpu = time.thread_time() - self._step_cpu
        batches = list(outputs.values())
        stats = next((b.scheduler_stats for b in batches if b.scheduler_stats), None)
        self._steps.append(
            StepRecord(
                start=self._step_start - self._t0,
                wall=wall,
                cpu=cpu,
                idle_before=self._idle_s,
                scheduled_tokens=stats.num_scheduled_tokens if stats else 0,
                running=stats.num_running_reqs if stats else 0,
                waiting=stats.num_waiting_reqs if stats else 0,
                outputs=sum(len(b.outputs) for b in batches),
                new_tokens=sum(len(o.new_token_ids) for b in batches for o in b.outputs),
            )
        )
        self._idle_s = 0.0

    # -- the output thread ---------------------------------------------------------
    def add_sent(self, encode_s: float, num_bytes: int) -> None:
        with self._lock:
            self._encode_s += encode_s
            self._bytes_sent += num_bytes
            self._messages += 1

    # -- report --------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        steps = [s for s in self._steps if s.scheduled_tokens > 0]
        decode = [s for s in steps if s.pure_decode]
        prefill = [s for s in steps if not s.pure_decode]
        new_tokens = sum(s.new_tokens for s in steps)
        span = (steps[-1].start + steps[-1].wall - steps[0].start) if steps else 0.0
        with self._lock:
            encode_s, sent, messages = self._encode_s, self._bytes_sent, self._messages

        def med(values: list[float]) -> float:
            return round(statistics.median(values), 5) if values else 0.0

        return {
            "steps": len(steps),
            "pure_decode_steps": len(decode),
            "prefill_steps": len(prefill),
            "span_s": round(span, 3),
            "step_wall_s": round(sum(s.wall for s in steps), 3),
            "step_cpu_s": round(sum(s.cpu for s in steps), 3),
            "decode_wall_s": round(sum(s.wall for s in decode), 3),
            "prefill_wall_s": round(sum(s.wall for s in prefill), 3),
            "idle_between_steps_s": round(sum(s.idle_before for s in steps[1:]), 3),
            "decode_step_wall_p50_s": med([s.wall for s in decode]),
            "decode_batch_p50": med([float(s.scheduled_tokens) for s in decode]),
            "prefill_step_wall_p50_s": med([s.wall for s in prefill]),
            "prefill_tokens_per_step_p50": med([float(s.scheduled_tokens) for s in prefill]),
            "new_tokens": new_tokens,
            "output_messages": messages,
            "output_encode_s": round(encode_s, 4),
            "output_bytes": sent,
            "output_bytes_per_token": round(sent / new_tokens, 1) if new_tokens else 0.0,
        }

    def write(self) -> None:
        """Write the trace to `path`; an error is logged (shutdown goes on regardless)."""
        doc = {"summary": self.summary(), "steps": [asdict(s) for s in self._steps]}
        try:
            with open(self.path, "w") as f:
                json.dump(doc, f)
        except OSError as exc:
            logger.error("cannot write the step trace to %s: %s", self.path, exc)
