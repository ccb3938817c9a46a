"""`DPLBAsyncClient`: N data-parallel engine cores behind one asyncio client.

It holds one `AsyncEngineCoreClient` per engine (each engine its own process,
scheduler and KV cache) and looks like a single one to `AsyncLLM`:

    add_request_async   -> the lightest live engine (`EngineLoadBalancer`)
    abort_requests_async-> the engine that holds each request
    get_output_async    <- one reader task per engine fans their batches into
                           one queue, each stamped with `engine_index`
    call_utility_async  -> every live engine; results combined (see there)

Failure (a documented choice): when one engine dies, the requests it held
finish at once with `finish_reason=ERROR` and a message naming the engine;
the other engines keep serving their requests and every new one.
`degraded_error` then says which engine is gone (the API's /health answers
503 with it, as vLLM's does when an engine core dies, so an orchestrator
replaces the server), while `dead_error` stays None until the last engine
is gone; then every request fails with `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from paged.scheduler.boundary import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from paged.server.engine.client import AsyncEngineCoreClient
from paged.server.engine.dp_balance import EngineLoadBalancer
from paged.server.engine.errors import EngineDeadError
from paged.server.engine.messages import EngineCoreInfo

logger = logging.getLogger(__name__)


class DPLBAsyncClient:
    """Balances requests over data-parallel engines; one output stream for all.

    Every coroutine must run on one event loop (the readers start on the loop
    of the first call), as for `AsyncMPClient`.
    """

    def __init__(
        self,
        engines: Sequence[AsyncEngineCoreClient],
        *,
        closers: Sequence[Callable[[], None]] = (),
    ) -> None:
        """`closers` run after the engines stop (e.g. the remote ranks' rendezvous socket)."""
        if not engines:
            raise ValueError("engines must hold at least one engine client")
        self.engines = list(engines)
        self._closers = list(closers)
        self.balancer = EngineLoadBalancer(len(self.engines))
        self._owner: dict[str, int] = {}  # engine request id -> engine index
        self._held: list[set[str]] = [set() for _ in self.engines]
        self._engine_errors: dict[int, EngineDeadError] = {}
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._readers: list[asyncio.Task[None]] = []
        self._all_dead: EngineDeadError | None = None
        self._closing = False

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    @property
    def info(self) -> EngineCoreInfo:
        """Engine 0's info (every engine runs the same configuration)."""
        return self.engines[0].info

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Set only once every engine is gone: until then the survivors serve."""
        self._notice_deaths()
        if self._all_dead is None and all(e.dead_error is not None for e in self.engines):
            return EngineDeadError(f"all {self.num_engines} data-parallel engines are dead")
        return self._all_dead

    @property
    def degraded_error(self) -> EngineDeadError | None:
        """Set once any engine is gone (what /health reports); None while all serve."""
        self._notice_deaths()
        for index, engine in enumerate(self.engines):
            error = self._engine_errors.get(index) or engine.dead_error
            if error is not None:
                live = len(self.balancer.live_engines())
                return EngineDeadError(
                    f"data-parallel engine {index} is dead ({error}); "
                    f"{live} of {self.num_engines} engines still serve"
                )
        return None

    def engine_of(self, request_id: str) -> int | None:
        """The engine that holds `request_id` (None once finished or unknown)."""
        return self._owner.get(request_id)

    # -- requests ------------------------------------------------------------------
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_started()
        rid = request.request_id
        while True:
            index = self.balancer.choose()
            if index is None:
                raise self._all_dead or EngineDeadError("every data-parallel engine is dead")
            # Recorded before the send: its first output may come back at once.
            self._owner[rid] = index
            self._held[index].add(rid)
            try:
                await self.engines[index].add_request_async(request)
            except EngineDeadError as exc:
                # Died between its last report and this send: try the next one.
                self._owner.pop(rid, None)
                self._held[index].discard(rid)
                self.balancer.release(index)
                self._mark_dead(index, exc)
                continue
            return

    async def abort_requests_async(self, request_ids: Sequence[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            index = self._owner.pop(rid, None)
            if index is not None:
                self._held[index].discard(rid)
                self.balancer.release(index)
                by_engine.setdefault(index, []).append(rid)
        for index, ids in by_engine.items():
            if self.balancer.loads[index].alive:
                try:
                    await self.engines[index].abort_requests_async(ids)
                except EngineDeadError as exc:
                    self._mark_dead(index, exc)

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs = self._ensure_started()
        item = await outputs.get()
        if isinstance(item, EngineDeadError):
            outputs.put_nowait(item)  # wake every other waiter too
            raise item
        return item

    # -- utilities -----------------------------------------------------------------
    async def call_utility_on(self, engine_index: int, method: str, *args: Any) -> Any:
        """Run a utility on one engine (e.g. `get_stats` for its own counters)."""
        if not 0 <= engine_index < self.num_engines:
            raise ValueError(f"engine_index must be in [0, {self.num_engines}), got {engine_index}")
        return await self.engines[engine_index].call_utility_async(method, *args)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Run a utility on every live engine, combined into one answer.

        bool results (`reset_prefix_cache`, `is_healthy`): all of them;
        int results (`get_num_unfinished_requests`): their sum; anything
        else (`get_stats`, `get_info`): engine 0's when alive, else the first
        live engine's (use `call_utility_on` for a given engine).
        """
        live = self.balancer.live_engines()
        if not live:
            raise self._all_dead or EngineDeadError("every data-parallel engine is dead")
        results = await asyncio.gather(
            *(self.engines[i].call_utility_async(method, *args) for i in live)
        )
        if all(isinstance(r, bool) for r in results):
            return all(results)
        if all(isinstance(r, int) for r in results):
            return sum(results)
        return results[0]

    async def check_health_async(self) -> None:
        """Raise `EngineDeadError` if any engine is gone or reports itself unhealthy."""
        degraded = self.degraded_error
        if degraded is not None:
            raise degraded
        if not await self.call_utility_async("is_healthy"):
            raise EngineDeadError("a data-parallel engine reports itself unhealthy")

    def shutdown(self) -> None:
        """Stop every engine; safe from any thread, and more than once.

        One after the other, on the calling thread: an engine client shut
        down from its event loop's thread cancels its reader there, which a
        helper thread could not do while this thread waits for it.
        """
        self._closing = True
        for task in self._readers:
            if not task.done():
                with contextlib.suppress(RuntimeError):  # its loop is already closed
                    task.get_loop().call_soon_threadsafe(task.cancel)
        for engine in self.engines:
            engine.shutdown()
        for close in self._closers:
            close()
        self._closers = []

    # -- internals (event loop) ----------------------------------------------------
    def _ensure_started(self) -> asyncio.Queue[EngineCoreOutputs | EngineDeadError]:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
            loop = asyncio.get_running_loop()
            self._readers = [
                loop.create_task(self._read(i), name=f"DPEngineReader-{i}")
                for i in range(self.num_engines)
            ]
        return self._outputs

    async def _read(self, index: int) -> None:
        client = self.engines[index]
        try:
            while True:
                batch = await client.get_output_async()
                self._on_batch(index, batch)
        except EngineDeadError as exc:
            if not self._closing:
                self._mark_dead(index, exc)

    def _on_batch(self, index: int, batch: EngineCoreOutputs) -> None:
        if batch.scheduler_stats is not None:
            self.balancer.report(index, batch.scheduler_stats)
        held = self._held[index]
        for out in batch.outputs:
            if out.finish_reason is not None and out.request_id in held:
                held.discard(out.request_id)
                self._owner.pop(out.request_id, None)
                self.balancer.release(index)
        if batch.engine_index != index:
            batch = msgspec.structs.replace(batch, engine_index=index)
        assert self._outputs is not None
        self._outputs.put_nowait(batch)

    def _notice_deaths(self) -> None:
        # The engines' monitor threads learn of a death before any reader does.
        for i, engine in enumerate(self.engines):
            if self.balancer.loads[i].alive and engine.dead_error is not None:
                self.balancer.mark_dead(i)  # no new requests; the reader fails its own

    def _mark_dead(self, index: int, error: EngineDeadError) -> None:
        if index in self._engine_errors:
            return
        self.balancer.mark_dead(index)
        self._engine_errors[index] = error
        held, self._held[index] = self._held[index], set()
        for rid in held:
            self._owner.pop(rid, None)
        detail = f"data-parallel engine {index} died: {error}"
        logger.error("%s; %d in-flight requests failed", detail, len(held))
        outputs = self._ensure_started()
        failed = [
            EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, finish_detail=detail)
            for rid in sorted(held)
        ]
        # Zeroed stats: its gauges must not keep showing the requests it lost.
        outputs.put_nowait(
            EngineCoreOutputs(
                outputs=failed,
                engine_index=index,
                scheduler_stats=SchedulerStats(),
                finished_requests=sorted(held) or None,
            )
        )
        if not self.balancer.live_engines():
            self._all_dead = EngineDeadError(
                f"all {self.num_engines} data-parallel engines are dead (engine {index}: {error})"
            )
            outputs.put_nowait(self._all_dead)
