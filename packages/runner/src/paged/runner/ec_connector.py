"""The worker side of an encoder-cache connector, as the runner sees it (seed: ECConnector).

The runner does not depend on paged-connectors: it defines the Protocol it
calls (`ECConnectorWorker`, satisfied by `paged.connectors.ec.ECConnectorBase`)
and the factory Protocol a worker uses to build one
(`ECConnectorWorkerFactory`, a picklable object the server supplies inside
`EngineConfig`). The connector is held by the `EncoderRunner` (composition).

One step with a connector, in the runner's order (`ECConnectorStep`):

    bind_connector_metadata(bytes)          SchedulerOutput.ec_connector_metadata, if any
    start_load_caches(encoder_cache)        consumer only
      encoder runs; producer: save_caches(encoder_cache, mm_hash) per encoded item
    get_finished(finished_req_ids), get_failed_loads() -> ECConnectorOutput
    clear_connector_metadata()
"""

from __future__ import annotations

from typing import Any, Protocol

from paged.runner.encoder_cache_buffer import PreallocatedEncoderCache


class ECConnectorWorker(Protocol):
    """What the runner calls on a worker-side EC connector; contracts in paged.connectors.ec."""

    @property
    def is_producer(self) -> bool: ...

    @property
    def is_consumer(self) -> bool: ...

    def register_caches(self, encoder_cache: PreallocatedEncoderCache) -> None: ...

    def bind_connector_metadata(self, connector_metadata: bytes) -> None: ...

    def clear_connector_metadata(self) -> None: ...

    def start_load_caches(self, encoder_cache: PreallocatedEncoderCache, **kwargs: Any) -> None: ...

    def save_caches(
        self, encoder_cache: PreallocatedEncoderCache, mm_hash: str, **kwargs: Any
    ) -> None: ...

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]: ...

    def get_failed_loads(self) -> set[str]: ...

    def shutdown(self) -> None: ...


class ECConnectorWorkerFactory(Protocol):
    """Builds the worker-side EC connector of one tensor-parallel rank (must be picklable)."""

    def make_worker_ec_connector(self, rank: int, world_size: int) -> ECConnectorWorker: ...
