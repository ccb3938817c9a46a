"""`MultiConnector`: several connectors behind one (vLLM's semantics).

    {"kv_connector": "MultiConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": "/tmp/a"}},
        {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": "/tmp/b"}}]}}

- Loads: the first child, in config order, that reports matched tokens is
  chosen for the request; only it is told about the external tokens (the
  others see 0). A child that cannot tell yet (None) makes the whole answer None.
- Saves: every child sees every request, so every child saves.
- A finished request is delayed while any child delays it; its id is
  reported in `finished_sending` only once every delaying child finished.
- Each child config inherits the parent's `engine_id` (as vLLM) and, when it
  has none, its `kv_role` (a convenience vLLM does not have).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import torch

from paged.connectors.kv.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from paged.connectors.kv.config import (
    KVTransferConfig,
    KVTransferConfigError,
    kv_transfer_config_from_dict,
)
from paged.connectors.kv.factory import KVConnectorFactory
from paged.kvcache import KVCacheBlocks
from paged.kvcache.events import KVCacheEvent
from paged.scheduler.boundary import (
    BlockIdsPerGroup,
    KVConnectorOutput,
    KVTransferParams,
    SchedulerOutput,
)
from paged.scheduler.request import Request


class MultiConnectorMetadata(msgspec.Struct, array_like=True, frozen=True):
    """Each child's metadata, in child order, plus extra pending async saves per request."""

    children: list[bytes]
    extra_async_saves: dict[str, int] = msgspec.field(default_factory=dict)


def child_configs(config: KVTransferConfig) -> list[KVTransferConfig]:
    """The child configs of `kv_connector_extra_config.connectors`; errors name the index."""
    raw = config.kv_connector_extra_config.get("connectors")
    if not isinstance(raw, list) or not raw:
        raise KVTransferConfigError(
            "MultiConnector needs kv_connector_extra_config.connectors: a non-empty list of "
            "kv_transfer_config objects"
        )
    children: list[KVTransferConfig] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise KVTransferConfigError(f"connectors[{i}] must be an object, got {item!r}")
        data: dict[str, Any] = {"engine_id": config.engine_id, "kv_role": config.kv_role, **item}
        try:
            children.append(kv_transfer_config_from_dict(data))
        except KVTransferConfigError as exc:
            raise KVTransferConfigError(f"connectors[{i}]: {exc}") from None
    return children


class MultiConnector(KVConnectorBase):
    """Composes child connectors; see the module docstring for the rules."""

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        context: KVConnectorContext,
        *,
        factory: KVConnectorFactory | None = None,
    ) -> None:
        super().__init__(config, role, context)
        factory = factory or KVConnectorFactory.with_builtins()
        self._connectors: list[KVConnectorBase] = [
            factory.create_connector(child, role, context) for child in child_configs(config)
        ]
        # Scheduler side: the child chosen to load each request.
        self._requests_to_connector: dict[str, int] = {}
        # Additional (beyond one) pending async saves per request; scheduler side
        # collects them, the metadata carries them to the worker side.
        self._extra_async_saves: dict[str, int] = {}

    @property
    def sub_connectors(self) -> list[KVConnectorBase]:
        return list(self._connectors)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_groups: Sequence[Sequence[str]] | None = None,
    ) -> None:
        super().register_kv_caches(kv_caches, layer_groups)
        for c in self._connectors:
            c.register_kv_caches(kv_caches, layer_groups)

    def bind_connector_metadata(self, metadata: bytes) -> None:
        super().bind_connector_metadata(metadata)
        meta = msgspec.msgpack.decode(metadata, type=MultiConnectorMetadata)
        if len(meta.children) != len(self._connectors):
            raise ValueError(
                f"MultiConnector metadata holds {len(meta.children)} children, "
                f"{len(self._connectors)} connectors are configured"
            )
        self._extra_async_saves.update(meta.extra_async_saves)
        for c, child in zip(self._connectors, meta.children, strict=True):
            c.bind_connector_metadata(child)

    def clear_connector_metadata(self) -> None:
        for c in self._connectors:
            c.clear_connector_metadata()
        super().clear_connector_metadata()

    def start_load_kv(self) -> None:
        for c in self._connectors:
            c.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        for c in self._connectors:
            c.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        for c in self._connectors:
            c.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        for c in self._connectors:
            c.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        for c in self._connectors:
            child_sending, child_recving = c.get_finished(finished_req_ids)
            recving |= child_recving or set()
            for req_id in child_sending or set():
                extra = self._extra_async_saves.get(req_id, 0)
                if extra == 0:
                    sending.add(req_id)
                elif extra == 1:
                    del self._extra_async_saves[req_id]
                else:
                    self._extra_async_saves[req_id] = extra - 1
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set()
        for c in self._connectors:
            errors |= c.get_block_ids_with_load_errors()
        return errors

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        for c in self._connectors:
            c.handle_preemptions(preempted_req_ids)

    # --------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        answer: tuple[int | None, bool] = (0, False)
        for i, c in enumerate(self._connectors):
            tokens, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if tokens is None:
                return None, False
            if answer[0] == 0 and tokens > 0:
                self._requests_to_connector[request.request_id] = i
                answer = (tokens, load_async)
        return answer

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        chosen = self._requests_to_connector.get(request.request_id, -1)
        for i, c in enumerate(self._connectors):
            c.update_state_after_alloc(request, blocks, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes:
        meta = MultiConnectorMetadata(
            children=[c.build_connector_meta(scheduler_output) for c in self._connectors],
            extra_async_saves=self._extra_async_saves,
        )
        self._extra_async_saves = {}
        return msgspec.msgpack.encode(meta)

    def request_finished(
        self, request: Request, block_ids: BlockIdsPerGroup
    ) -> tuple[bool, KVTransferParams | None]:
        async_saves = 0
        params: KVTransferParams | None = None
        for c in self._connectors:
            delay, child_params = c.request_finished(request, block_ids)
            async_saves += int(delay)
            if child_params is not None:
                if params is not None and params != child_params:
                    raise RuntimeError(
                        "MultiConnector: two connectors returned different kv_transfer_params "
                        f"for request {request.request_id!r}"
                    )
                params = child_params
        if async_saves > 1:
            self._extra_async_saves[request.request_id] = async_saves - 1
        self._requests_to_connector.pop(request.request_id, None)
        return async_saves > 0, params

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for c in self._connectors:
            c.update_connector_output(connector_output)

    def take_events(self) -> Sequence[KVCacheEvent]:
        events: list[KVCacheEvent] = []
        for c in self._connectors:
            events.extend(c.take_events())
        return events

    def shutdown(self) -> None:
        for c in self._connectors:
            c.shutdown()
