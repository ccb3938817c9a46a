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
from typing import Any, Protocol

from paged.kvcache import KVCacheBlocks
from paged.kvcache.events import KVCacheEvent
from paged.scheduler.boundary import (
    BlockIdsPerGroup,
    ECConnectorMetadata,
    ECConnectorOutput,
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
    """Scheduler side of an encoder-cache connector (seed: ECConnector; vLLM's gaps 1-2).

    Lives in the engine core, next to the scheduler; talks to its worker side
    only through `SchedulerOutput.ec_connector_metadata` (the msgpack of what
    `build_connector_meta` returns) and `ModelRunnerOutput.ec_connector_output`.
    Call order, per `schedule()`:

        has_cache_item(mm_hash, request)   for an item that is neither in the encoder
                                           cache nor already chosen this step
        is_async_load(mm_hash)             only if has_cache_item said True
        update_state_after_alloc(req, i)   the item got encoder-cache space and will be
                                           loaded, not encoded
        build_connector_meta(output)       once, at the end of schedule(); resets step state

    after each step: `update_connector_output(ec_connector_output)` (before the
    scheduler consumes the same output's finished/failed loads); when a request
    ends for any reason (finished, aborted, failed): `request_finished(request)`.

    A synchronous load (`is_async_load` False) lands in the worker's encoder
    cache before the same step's forward, so the item's tokens run in that step.
    An asynchronous one lands later: the scheduler runs none of the request's
    tokens from that item's placeholder on until the worker lists the hash in
    `ECConnectorOutput.finished_recving` (or `failed_recving`, then it encodes
    the item itself); other requests keep being scheduled meanwhile.
    """

    def has_cache_item(self, identifier: str, request: Request | None = None) -> bool:
        """Whether the encoder output of item `identifier` (mm hash) can be loaded.

        `request` is the request that needs it (paged's addition to vLLM's
        signature; None when asked outside a request), so a connector can read
        its `ec_transfer_params` (vLLM 0.33: which producer holds the item).
        Hot path (once per uncached item per step): answer from local state,
        never block on I/O. Must not mutate state a False answer would leave behind.
        """
        ...

    def is_async_load(self, identifier: str) -> bool:
        """Whether loading `identifier` completes after the step that starts it.

        Only asked after `has_cache_item(identifier)` returned True.
        """
        ...

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Item `index` of `request` got encoder-cache space and is to be loaded, not computed.

        The connector records it so that the next `build_connector_meta` tells
        the worker side to load it (mm hash and number of embeddings).
        """
        ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """This step's loads (and saves) for the worker side; resets per-step state.

        Must not modify `scheduler_output`.
        """
        ...

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        """The worker side's report for the last step (finished/failed loads and saves)."""
        ...

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """`request` ended (finished, aborted or failed): free what the connector held for it.

        Returns (delay_free, params). delay_free=True: the connector still sends
        this request's encoder outputs; the scheduler keeps the request's
        encoder-cache references until every mm hash of the request has been
        listed in `finished_sending`. `params` (or None) are connector-specific
        details for the response, as vLLM's `ec_transfer_params`.
        """
        ...
