"""`SinkFullAttentionManager`: full attention plus reserved attention-sink blocks."""

from __future__ import annotations

from paged.kvcache.block_pool import BlockPool
from paged.kvcache.managers.full_attention import FullAttentionManager
from paged.kvcache.specs import KVCacheSpec, SinkFullAttentionSpec


class SinkFullAttentionManager(FullAttentionManager):
    """Reserves `sink_len // block_size` blocks at construction for the sink tokens.

    StreamingLLM-style sinks are shared by every request and never freed, so
    they are taken out of circulation with `BlockPool.reserve_blocks`; lookup
    and common-prefix logic are those of full attention.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
    ) -> None:
        if not isinstance(kv_cache_spec, SinkFullAttentionSpec):
            raise ValueError(
                f"SinkFullAttentionManager needs a SinkFullAttentionSpec, got {kv_cache_spec}"
            )
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id)
        assert kv_cache_spec.sink_len is not None  # validated by the spec
        self.sink_blocks = block_pool.reserve_blocks(kv_cache_spec.sink_len // self.block_size)
