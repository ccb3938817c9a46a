"""Scheduler-side connector Protocols (seed: KV Transfer, ECConnector).

A connector is split by role: the *scheduler* side (these Protocols) decides
what to load or save and packs it into opaque metadata bytes carried by
`SchedulerOutput`; the *worker* side (in paged.connectors / paged.runner)
decodes them and moves data. paged-connectors implements these Protocols;
the scheduler never imports it.

KV connector call order within one `schedule()` for a waiting request:

    get_num_new_matched_tokens(request, num_local_computed)  -> (N | None, is_async)
    KVCacheManager.allocate_slots(..., num_external_computed_tokens=N,
                                  delay_cache_blocks=is_async)
    update_state_after_alloc(request, blocks, N)
    ... after all requests: build_connector_meta(scheduler_output) -> bytes

and after a step: `update_connector_output(kv_connector_output)`; when a
request finishes: `request_finished(request, block_ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from paged.kvcache import KVCacheBlocks
from paged.kvcache.events import KVCacheEvent
from paged.scheduler.boundary import (
    BlockIdsPerGroup,
    KVConnectorOutput,
    KVTransferParams,
    SchedulerOutput,
)
from paged.scheduler.request import Request


class KVConnectorScheduler(Protocol):
    """Scheduler side of a KV connector (external prefix cache, P/D disaggregation)."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many tokens beyond the `num_computed_tokens` local hit the connector can supply.

        The four answers of the seed:
        - `(N, False)`: N external tokens, loaded synchronously during the next forward;
        - `(N, True)`: N external tokens loaded asynchronously; the request waits in
          WAITING_FOR_REMOTE_KVS until the worker reports `finished_recving`;
        - `(None, _)`: cannot tell yet; the scheduler skips the request this step and asks again;
        - `(0, False)`: nothing external.
        Must not mutate the request. N must leave at least one token to compute.
        """
        ...

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Called once blocks are allocated for a request it matched (N may be 0)."""
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes:
        """Pack this step's loads/saves for the worker side and reset per-step state."""
        ...

    def request_finished(
        self, request: Request, block_ids: BlockIdsPerGroup
    ) -> tuple[bool, KVTransferParams | None]:
        """A request finished. Returns (delay_free, params for the frontend).

        `delay_free=True`: the connector is still sending these blocks; the
        scheduler keeps them allocated until the worker reports the request in
        `finished_sending`.
        """
        ...

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Feedback from the worker side after each step (finished transfers, errors)."""
        ...

    def take_events(self) -> Sequence[KVCacheEvent]:
        """KV cache events the connector produced since the last call."""
        ...

    def get_kv_connector_stats(self) -> dict[str, float] | None:
        """Scheduler-side counters since the last call ("name" -> increment), or None."""
        ...


class ECConnectorScheduler(Protocol):
    """Scheduler side of an encoder-cache connector (encoder/prefill/decode disaggregation)."""

    def has_cache_item(self, identifier: str) -> bool:
        """Whether an encoder output for `identifier` (mm hash) can be loaded; hot path, be fast."""
        ...

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Item `index` of `request` got encoder-cache space and will be loaded, not computed."""
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes:
        """Pack this step's loads for the worker side and reset per-step state."""
        ...
