"""`MultiECConnector`: several encoder-cache connectors behind one (vLLM's gap 5).

    {"ec_connector": "MultiECConnector", "ec_role": "ec_both",
     "ec_connector_extra_config": {"connectors": [
        {"ec_connector": "ECExampleConnector",
         "ec_connector_extra_config": {"shared_storage_path": "/fast/ec"}},
        {"ec_connector": "ECExampleConnector",
         "ec_connector_extra_config": {"shared_storage_path": "/shared/ec"}}]}}

- Loads are tried in config order: `has_cache_item` asks the children in turn
  and the first that has the item is the one that loads it (only that child
  is told through `update_state_after_alloc`; `is_async_load` is its answer).
- Saves go to every child that is a producer.
- Worker reports (`get_finished`, `get_failed_loads`) are the union of the
  children's; `update_connector_output` and `request_finished` reach every
  child, and a finished request is delayed while any child delays it.
- A child config inherits the parent's `engine_id` and, when it has none, its
  `ec_role` (and `ec_load_failure_policy`).
- Children are built with a factory of the built-in connectors, or loaded
  from their own `ec_connector_module_path`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from paged.connectors.ec.base import (
    ECConnectorBase,
    ECConnectorContext,
    ECConnectorRole,
    EncoderCache,
)
from paged.connectors.ec.config import (
    ECTransferConfig,
    ECTransferConfigError,
    ec_transfer_config_from_dict,
)
from paged.connectors.ec.factory import ECConnectorFactory
from paged.scheduler.boundary import ECConnectorMetadata, ECConnectorOutput, SchedulerOutput
from paged.scheduler.request import Request


class MultiECConnectorMetadata(ECConnectorMetadata, frozen=True):
    """Each child's metadata (msgpack bytes), in child order."""

    children: list[bytes] = msgspec.field(default_factory=list)


def child_configs(config: ECTransferConfig) -> list[ECTransferConfig]:
    """The child configs of `ec_connector_extra_config.connectors`; errors name the index."""
    raw = config.ec_connector_extra_config.get("connectors")
    if not isinstance(raw, list) or not raw:
        raise ECTransferConfigError(
            "MultiECConnector needs ec_connector_extra_config.connectors: a non-empty list of "
            "ec_transfer_config objects"
        )
    children: list[ECTransferConfig] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ECTransferConfigError(f"connectors[{i}] must be an object, got {item!r}")
        if item.get("ec_connector") == "MultiECConnector":
            raise ECTransferConfigError(f"connectors[{i}]: a MultiECConnector cannot nest")
        data: dict[str, Any] = {
            "engine_id": config.engine_id,
            "ec_role": config.ec_role,
            "ec_load_failure_policy": config.ec_load_failure_policy,
            **item,
        }
        try:
            children.append(ec_transfer_config_from_dict(data))
        except ECTransferConfigError as exc:
            raise ECTransferConfigError(f"connectors[{i}]: {exc}") from None
    return children


class MultiECConnector(ECConnectorBase):
    """Composes child encoder-cache connectors; the module docstring gives the rules."""

    def __init__(
        self, config: ECTransferConfig, role: ECConnectorRole, context: ECConnectorContext
    ) -> None:
        super().__init__(config, role, context)
        factory = ECConnectorFactory.with_builtins()
        self.children: list[ECConnectorBase] = [
            factory.create_connector(child, role, context) for child in child_configs(config)
        ]
        # Scheduler side: which child loads each item chosen this step.
        self._chosen: dict[str, ECConnectorBase] = {}

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()

    # ------------------------------------------------------------------ worker side

    def register_caches(self, encoder_cache: EncoderCache) -> None:
        super().register_caches(encoder_cache)
        for child in self.children:
            child.register_caches(encoder_cache)

    def bind_connector_metadata(self, connector_metadata: bytes) -> None:
        super().bind_connector_metadata(connector_metadata)
        metadata = self._get_connector_metadata(MultiECConnectorMetadata)
        if len(metadata.children) != len(self.children):
            raise ValueError(
                f"MultiECConnector metadata has {len(metadata.children)} children, "
                f"this connector {len(self.children)}"
            )
        for child, child_bytes in zip(self.children, metadata.children, strict=True):
            child.bind_connector_metadata(child_bytes)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self.children:
            child.clear_connector_metadata()

    def start_load_caches(self, encoder_cache: EncoderCache, **kwargs: Any) -> None:
        for child in self.children:
            child.start_load_caches(encoder_cache, **kwargs)

    def save_caches(self, encoder_cache: EncoderCache, mm_hash: str, **kwargs: Any) -> None:
        for child in self.children:
            if child.is_producer:
                child.save_caches(encoder_cache, mm_hash, **kwargs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        for child in self.children:
            child_sending, child_recving = child.get_finished(finished_req_ids)
            sending |= child_sending or set()
            recving |= child_recving or set()
        return sending or None, recving or None

    def get_failed_loads(self) -> set[str]:
        failed: set[str] = set()
        for child in self.children:
            failed |= child.get_failed_loads()
        return failed

    # --------------------------------------------------------------- scheduler side

    def has_cache_item(self, identifier: str, request: Request | None = None) -> bool:
        for child in self.children:
            if child.has_cache_item(identifier, request):
                self._chosen[identifier] = child
                return True
        self._chosen.pop(identifier, None)
        return False

    def _loader(self, identifier: str) -> ECConnectorBase:
        child = self._chosen.get(identifier)
        if child is None and self.has_cache_item(identifier):
            child = self._chosen[identifier]
        if child is None:
            raise ValueError(f"MultiECConnector: no child has mm_hash {identifier}")
        return child

    def is_async_load(self, identifier: str) -> bool:
        return self._loader(identifier).is_async_load(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        self._loader(identifier).update_state_after_alloc(request, index)
        self._chosen.pop(identifier, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        self._chosen.clear()
        return MultiECConnectorMetadata(
            children=[
                msgspec.msgpack.encode(child.build_connector_meta(scheduler_output))
                for child in self.children
            ]
        )

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        for child in self.children:
            child.update_connector_output(connector_output)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        delay = False
        params: dict[str, Any] = {}
        for child in self.children:
            child_delay, child_params = child.request_finished(request)
            delay = delay or child_delay
            params.update(child_params or {})
        return delay, params or None
