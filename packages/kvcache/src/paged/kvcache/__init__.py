"""paged.kvcache: block pool, prefix caching and KV cache managers (stdlib only).

The public API is re-exported here; see the package README for a tour.
"""

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.block_pool import BlockPool
from paged.kvcache.config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    get_kv_cache_config,
    get_max_concurrency_for_kv_cache_config,
    unify_kv_cache_spec_page_size,
)
from paged.kvcache.coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from paged.kvcache.errors import (
    BlockStateError,
    KVCacheError,
    KVCacheIntegrityError,
    NotEnoughBlocksError,
    UnknownRequestError,
)
from paged.kvcache.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from paged.kvcache.free_queue import FreeKVCacheBlockQueue
from paged.kvcache.hash_map import BlockHashToBlockMap
from paged.kvcache.hashing import (
    BlockHashListWithBlockSize,
    HashFn,
    RequestBlockHasher,
    encode_canonical,
    generate_block_hash_extra_keys,
    get_hash_fn_by_name,
    get_none_hash,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    need_extra_keys,
    published_extra_keys,
    sha256,
    xxhash,
)
from paged.kvcache.ids import (
    BlockHash,
    BlockHashWithGroupId,
    BlockId,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from paged.kvcache.manager import KVCacheBlocks, KVCacheManager
from paged.kvcache.managers import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
    spec_manager_map,
)
from paged.kvcache.metrics import (
    BlockMetricsState,
    KVCacheEvictionEvent,
    KVCacheMetricsCollector,
)
from paged.kvcache.protocols import (
    HashableRequest,
    KVCacheRequest,
    MultiModalFeatureLike,
    PlaceholderLike,
)
from paged.kvcache.request import SimpleRequest
from paged.kvcache.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    get_dtype_size,
)
from paged.kvcache.stats import PrefixCacheStats

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "AttentionSpec",
    "BlockHash",
    "BlockHashListWithBlockSize",
    "BlockHashToBlockMap",
    "BlockHashWithGroupId",
    "BlockId",
    "BlockMetricsState",
    "BlockPool",
    "BlockRemoved",
    "BlockStateError",
    "BlockStored",
    "ChunkedLocalAttentionManager",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionManager",
    "CrossAttentionSpec",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "HashFn",
    "HashableRequest",
    "HybridKVCacheCoordinator",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "KVCacheError",
    "KVCacheEvent",
    "KVCacheEvictionEvent",
    "KVCacheGroupSpec",
    "KVCacheIntegrityError",
    "KVCacheManager",
    "KVCacheMetricsCollector",
    "KVCacheRequest",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaManager",
    "MambaSpec",
    "MultiModalFeatureLike",
    "NotEnoughBlocksError",
    "PlaceholderLike",
    "PrefixCacheStats",
    "RequestBlockHasher",
    "SimpleRequest",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SinkFullAttentionSpec",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "UnitaryKVCacheCoordinator",
    "UnknownRequestError",
    "encode_canonical",
    "generate_block_hash_extra_keys",
    "get_block_hash",
    "get_dtype_size",
    "get_group_id",
    "get_hash_fn_by_name",
    "get_kv_cache_config",
    "get_kv_cache_coordinator",
    "get_manager_for_kv_cache_spec",
    "get_max_concurrency_for_kv_cache_config",
    "get_none_hash",
    "get_request_block_hasher",
    "hash_block_tokens",
    "init_none_hash",
    "make_block_hash_with_group_id",
    "need_extra_keys",
    "published_extra_keys",
    "sha256",
    "spec_manager_map",
    "unify_kv_cache_spec_page_size",
    "xxhash",
]
