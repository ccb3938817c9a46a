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

__all__ = [
    "KVConnectorBase",
    "KVConnectorContext",
    "KVConnectorFactory",
    "KVConnectorLoadError",
    "KVConnectorRole",
    "KVConnectorRoleError",
    "KVTransferConfig",
    "KVTransferConfigError",
    "kv_transfer_config_from_dict",
    "parse_kv_transfer_config",
]
