"""One `SingleTypeKVCacheManager` per attention type."""

from paged.kvcache.managers.base import SingleTypeKVCacheManager
from paged.kvcache.managers.chunked_local import ChunkedLocalAttentionManager
from paged.kvcache.managers.cross_attention import CrossAttentionManager
from paged.kvcache.managers.full_attention import FullAttentionManager
from paged.kvcache.managers.mamba import MambaManager
from paged.kvcache.managers.registry import (
    get_manager_class,
    get_manager_for_kv_cache_spec,
    spec_manager_map,
)
from paged.kvcache.managers.sink import SinkFullAttentionManager
from paged.kvcache.managers.sliding_window import SlidingWindowManager

__all__ = [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SlidingWindowManager",
    "get_manager_class",
    "get_manager_for_kv_cache_spec",
    "spec_manager_map",
]
