"""Which manager serves which spec (`spec_manager_map`)."""

from __future__ import annotations

from paged.kvcache.block_pool import BlockPool
from paged.kvcache.managers.base import SingleTypeKVCacheManager
from paged.kvcache.managers.chunked_local import ChunkedLocalAttentionManager
from paged.kvcache.managers.cross_attention import CrossAttentionManager
from paged.kvcache.managers.full_attention import FullAttentionManager
from paged.kvcache.managers.mamba import MambaManager
from paged.kvcache.managers.sink import SinkFullAttentionManager
from paged.kvcache.managers.sliding_window import SlidingWindowManager
from paged.kvcache.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLAAttentionSpec: FullAttentionManager,  # one latent per token: same bookkeeping
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
    SinkFullAttentionSpec: SinkFullAttentionManager,
}


def get_manager_class(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class for the exact type of `kv_cache_spec`."""
    try:
        return spec_manager_map[type(kv_cache_spec)]
    except KeyError:
        raise ValueError(
            f"no KV cache manager for spec type {type(kv_cache_spec).__name__}"
        ) from None


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool, kv_cache_group_id: int
) -> SingleTypeKVCacheManager:
    """Instantiate the manager for `kv_cache_spec`."""
    return get_manager_class(kv_cache_spec)(
        kv_cache_spec, block_pool, enable_caching, kv_cache_group_id
    )
