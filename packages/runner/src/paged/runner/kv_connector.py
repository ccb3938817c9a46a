"""The worker side of a KV connector, as the model runner sees it (seed: KV Transfer).

The runner does not depend on paged-connectors: it defines the Protocol it
calls (`KVConnectorWorker`) and the factory Protocol a worker uses to build
one (`KVConnectorWorkerFactory`); paged-connectors implements the first, the
server supplies the second (a picklable object, so that it reaches worker
processes inside `EngineConfig`).

One step with a connector (`KVConnectorStep`):

    handle_preemptions(preempted)           if the scheduler preempted requests
    bind_connector_metadata(bytes)          SchedulerOutput.kv_connector_metadata
    start_load_kv()
      forward: per layer wait_for_layer_load / save_kv_layer (via ForwardContext)
    wait_for_save()
    get_finished(finished_req_ids), get_block_ids_with_load_errors() -> KVConnectorOutput
    clear_connector_metadata()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from paged.runner.attention.metadata import KVLayerHooks
from paged.scheduler.boundary import KVConnectorOutput, SchedulerOutput


class KVConnectorWorker(KVLayerHooks, Protocol):
    """What the runner calls on a worker-side KV connector; contracts in paged.connectors."""

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_groups: Sequence[Sequence[str]] | None = None,
    ) -> None: ...

    def bind_connector_metadata(self, metadata: bytes) -> None: ...

    def clear_connector_metadata(self) -> None: ...

    def start_load_kv(self) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]: ...

    def get_block_ids_with_load_errors(self) -> set[int]: ...

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None: ...

    def get_kv_connector_stats(self) -> dict[str, float] | None: ...

    def shutdown(self) -> None: ...


class KVConnectorWorkerFactory(Protocol):
    """Builds the worker-side connector of one tensor-parallel rank (must be picklable)."""

    def make_worker_connector(self, rank: int, world_size: int) -> KVConnectorWorker: ...


class KVConnectorStep:
    """Drives one step's connector calls around the forward; see the module docstring."""

    def __init__(self, connector: KVConnectorWorker, scheduler_output: SchedulerOutput) -> None:
        self.connector = connector
        self.scheduler_output = scheduler_output
        self.bound = scheduler_output.kv_connector_metadata is not None

    def begin(self) -> None:
        """Before the forward: preemptions, bind the metadata, start the loads."""
        so = self.scheduler_output
        if so.preempted_req_ids:
            self.connector.handle_preemptions(set(so.preempted_req_ids))
        if so.kv_connector_metadata is not None:
            self.connector.bind_connector_metadata(so.kv_connector_metadata)
            self.connector.start_load_kv()

    def finish(self) -> KVConnectorOutput:
        """After the forward (or instead of it): wait for saves, collect results, clear."""
        try:
            if self.bound:
                self.connector.wait_for_save()
            sending, recving = self.connector.get_finished(
                set(self.scheduler_output.finished_req_ids)
            )
            invalid = self.connector.get_block_ids_with_load_errors()
            stats = self.connector.get_kv_connector_stats()
        finally:
            if self.bound:
                self.connector.clear_connector_metadata()
        return KVConnectorOutput(
            finished_sending=sorted(sending or ()),
            finished_recving=sorted(recving or ()),
            invalid_block_ids=sorted(invalid),
            kv_connector_stats=stats or {},
        )

    def abort(self) -> None:
        """The forward raised: drop the metadata so the next step starts clean."""
        if self.bound:
            self.connector.clear_connector_metadata()
