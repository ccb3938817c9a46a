"""OffloadingConnector: chunked KV in host-memory and disk tiers (seed: LMCache)."""

from paged.connectors.kv.offloading.chunks import ChunkError, ChunkKey, Fingerprint
from paged.connectors.kv.offloading.config import OffloadingConfig
from paged.connectors.kv.offloading.connector import OffloadingConnector

__all__ = ["ChunkError", "ChunkKey", "Fingerprint", "OffloadingConfig", "OffloadingConnector"]
