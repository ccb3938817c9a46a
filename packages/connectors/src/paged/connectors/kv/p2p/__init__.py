"""Prefill/decode disaggregation between two paged engines over ZMQ (`PagedZmqConnector`)."""

from paged.connectors.kv.p2p.config import ZmqConnectorConfig
from paged.connectors.kv.p2p.connector import PagedZmqConnector
from paged.connectors.kv.p2p.handshake import KVHandshakeError, KVLayoutInfo, check_compatible

__all__ = [
    "KVHandshakeError",
    "KVLayoutInfo",
    "PagedZmqConnector",
    "ZmqConnectorConfig",
    "check_compatible",
]
