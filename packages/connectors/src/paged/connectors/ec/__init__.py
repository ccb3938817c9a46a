"""Encoder-cache connectors (seed: ECConnector): base class, factory, config, connectors."""

from paged.connectors.ec.base import (
    ECConnectorBase,
    ECConnectorContext,
    ECConnectorRole,
    ECConnectorRoleError,
    EncoderCache,
)
from paged.connectors.ec.config import (
    EC_ROLES,
    ECTransferConfig,
    ECTransferConfigError,
    ec_transfer_config_from_dict,
    normalize_ec_role,
    parse_ec_transfer_config,
)
from paged.connectors.ec.factory import ECConnectorFactory, ECConnectorLoadError

__all__ = [
    "EC_ROLES",
    "ECConnectorBase",
    "ECConnectorContext",
    "ECConnectorFactory",
    "ECConnectorLoadError",
    "ECConnectorRole",
    "ECConnectorRoleError",
    "ECTransferConfig",
    "ECTransferConfigError",
    "EncoderCache",
    "ec_transfer_config_from_dict",
    "normalize_ec_role",
    "parse_ec_transfer_config",
]
