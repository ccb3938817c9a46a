"""`OffloadingConnector`: a tiered KV store (host memory, local disk) in the spirit of LMCache.

One class, two roles: the scheduler-side instance composes `OffloadingScheduler`
(indexes, lookups, save decisions), the worker-side one `OffloadingWorker`
(cross-layer copies, tier storage, the background writer). See those modules
for the data flow and `config.py` for the `kv_connector_extra_config` keys.
Loads are synchronous for the scheduler (`get_num_new_matched_tokens` answers
`(N, False)`: the blocks are filled during the step that first computes the
request); with `use_layerwise` the worker fills them layer by layer while
that step's forward runs (docs/layerwise.md). Hybrid models: one chunk per KV
cache group, a sliding-window group's only within its window (scheduler_side.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from paged.connectors.kv.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from paged.connectors.kv.config import KVTransferConfig
from paged.connectors.kv.offloading.config import OffloadingConfig
from paged.connectors.kv.offloading.metadata import OffloadingMetadata
from paged.connectors.kv.offloading.scheduler_side import OffloadingScheduler
from paged.connectors.kv.offloading.worker_side import OffloadingWorker
from paged.kvcache import KVCacheBlocks, KVCacheEvent
from paged.scheduler.boundary import (
    BlockIdsPerGroup,
    KVConnectorOutput,
    KVTransferParams,
    SchedulerOutput,
)
from paged.scheduler.request import Request


class OffloadingConnector(KVConnectorBase):
    """Prompt chunks saved to host memory and/or disk, loaded back on a device-cache miss."""

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext
    ) -> None:
        super().__init__(config, role, context)
        self.offload_config = OffloadingConfig.from_extra_config(
            config.kv_connector_extra_config, context.block_size, context.world_size
        )
        self._scheduler: OffloadingScheduler | None = None
        self._worker: OffloadingWorker | None = None
        self._layer_index: dict[str, int] = {}
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = OffloadingScheduler(
                self.offload_config,
                context.block_size,
                context.kv_bytes_per_block,
                can_load=config.is_kv_consumer,
                can_save=config.is_kv_producer,
                world_size=context.world_size,
                model_name=context.model_name,
                groups=context.group_layouts(),
            )

    @property
    def scheduler_side(self) -> OffloadingScheduler:
        self._require_role(KVConnectorRole.SCHEDULER, "scheduler_side")
        assert self._scheduler is not None  # built with the role
        return self._scheduler

    @property
    def worker_side(self) -> OffloadingWorker:
        self._require_role(KVConnectorRole.WORKER, "worker_side")
        if self._worker is None:
            raise RuntimeError("OffloadingConnector: register_kv_caches must come first")
        return self._worker

    # --------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: BlockIdsPerGroup
    ) -> tuple[bool, KVTransferParams | None]:
        self.scheduler_side.request_finished(request)
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_groups: Sequence[Sequence[str]] | None = None,
    ) -> None:
        super().register_kv_caches(kv_caches, layer_groups)
        self._layer_index = {name: i for i, name in enumerate(self._kv_caches)}
        self._worker = OffloadingWorker(
            self.offload_config,
            self._kv_caches,
            self.offload_config.chunk_size // self.context.block_size,
            self.context.rank,
            self.context.world_size,
            self._layer_groups,
            model_name=self.context.model_name,
        )

    def _metadata(self) -> OffloadingMetadata:
        return self._decoded_connector_metadata(OffloadingMetadata)

    def start_load_kv(self) -> None:
        if self.offload_config.use_layerwise:
            self.worker_side.start_layerwise(self._metadata())
        else:
            self.worker_side.load(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: block until this layer's loads are in the cache (else loaded already)."""
        if self.offload_config.use_layerwise and self.has_connector_metadata():
            self.worker_side.wait_layer(self._layer_of(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Layer-wise: copy this layer's saved blocks out now (else all in `wait_for_save`)."""
        if self.offload_config.use_layerwise and self.has_connector_metadata():
            self.worker_side.save_layer(self._layer_of(layer_name))

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        if self.offload_config.use_layerwise:
            self.worker_side.finish_layerwise(self._metadata())
        else:
            self.worker_side.save(self._metadata())

    def clear_connector_metadata(self) -> None:
        # A step whose forward raised never reached wait_for_save: its load thread must
        # stop before the blocks are reused (its failures are still reported).
        if self._worker is not None and self.offload_config.use_layerwise:
            self._worker.finish_layerwise()
        super().clear_connector_metadata()

    def _layer_of(self, layer_name: str) -> int:
        index = self._layer_index.get(layer_name)
        if index is None:
            raise KeyError(f"OffloadingConnector: unknown KV cache layer {layer_name!r}")
        return index

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> dict[str, float] | None:
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        if self._worker is not None:
            return self._worker.take_stats()
        return None

    def take_events(self) -> Sequence[KVCacheEvent]:
        # The tiers' events are scheduler-side decisions; a worker has none.
        if self._scheduler is not None:
            return self._scheduler.take_events()
        return ()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
