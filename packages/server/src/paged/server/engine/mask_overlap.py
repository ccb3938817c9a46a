"""`GrammarMaskOverlap`: the grammar bitmask is computed while the model runs.

    EngineCore.step()
      so = scheduler.schedule()
      pending = masks.start(so)          mask thread: scheduler.get_grammar_bitmask(so)
      executor.execute_model(so)         this thread: the forward pass, at the same time
      executor.sample_tokens(pending.result())

Both sides drop the GIL for their heavy part (llguidance fills masks in its
own Rust thread pool; torch runs its kernels, or the GPU does), so the mask
costs the step only what the forward pass does not hide. Safe because
nothing else touches the scheduler while the forward pass runs: the
executor reads only the `SchedulerOutput`, and the engine thread waits for
the mask before `update_from_output` mutates any request.

A step with no constrained request scheduled skips the thread hop.
`enabled=False` computes the mask after `execute_model` returns (the
benchmark's "without overlap").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from paged.scheduler.boundary import GrammarOutput, SchedulerOutput
from paged.scheduler.request import Request


class PendingMask:
    """A mask being computed (or already known); `result()` waits for it."""

    __slots__ = ("_future", "_thunk")

    def __init__(
        self,
        future: Future[GrammarOutput | None] | None = None,
        thunk: Callable[[], GrammarOutput | None] | None = None,
    ) -> None:
        self._future = future
        self._thunk = thunk  # computed on result() (overlap off)

    def result(self) -> GrammarOutput | None:
        if self._future is not None:
            return self._future.result()
        return self._thunk() if self._thunk is not None else None


_NO_MASK = PendingMask()


class GrammarMaskOverlap:
    """Runs `compute_mask` on one helper thread while the engine thread runs the model."""

    def __init__(
        self,
        compute_mask: Callable[[SchedulerOutput], GrammarOutput | None],
        requests: Callable[[], Mapping[str, Request]] | None,
        *,
        enabled: bool = True,
    ) -> None:
        """`requests`: the scheduler's live requests by id (None: every step is constrained)."""
        self._compute = compute_mask
        self._requests = requests
        self.enabled = enabled
        self._pool: ThreadPoolExecutor | None = None

    def start(self, scheduler_output: SchedulerOutput) -> PendingMask:
        """Begin this step's mask (call before `execute_model`); always `result()` it."""
        if not self._has_constrained(scheduler_output):
            return _NO_MASK
        if not self.enabled:
            return PendingMask(thunk=lambda: self._compute(scheduler_output))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-mask")
        return PendingMask(self._pool.submit(self._compute, scheduler_output))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _has_constrained(self, scheduler_output: SchedulerOutput) -> bool:
        if not scheduler_output.num_scheduled_tokens:
            return False
        if self._requests is None:
            return True
        requests = self._requests()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is not None and request.sampling_params.structured_outputs is not None:
                return True
        return False
