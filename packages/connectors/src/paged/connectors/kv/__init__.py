"""KV connectors: base class, factory, config, and the connectors built on them."""

from paged.connectors.kv.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorRole,
    KVConnectorRoleError,
)
from paged.connectors.kv.config import (
    KVTransferConfig,
    KVTransferConfigError,
    kv_transfer_config_from_dict,
    parse_kv_transfer_config,
)
from paged.connectors.kv.factory import KVConnectorFactory, KVConnectorLoadError
from paged.connectors.kv.groups import GroupLayout, group_layouts, window_start_block

__all__ = [
    "GroupLayout",
    "KVConnectorBase",
    "KVConnectorContext",
    "KVConnectorFactory",
    "KVConnectorLoadError",
    "KVConnectorRole",
    "KVConnectorRoleError",
    "KVTransferConfig",
    "KVTransferConfigError",
    "group_layouts",
    "kv_transfer_config_from_dict",
    "parse_kv_transfer_config",
    "window_start_block",
]
