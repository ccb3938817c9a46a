"""`CrossAttentionManager`: decoder-to-encoder attention of encoder-decoder models."""

from __future__ import annotations

from collections.abc import Sequence

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.block_pool import BlockPool
from paged.kvcache.ids import BlockHash
from paged.kvcache.managers.base import SingleTypeKVCacheManager
from paged.kvcache.protocols import KVCacheRequest
from paged.kvcache.specs import CrossAttentionSpec, KVCacheSpec


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Blocks for the encoder output, allocated once per request; no prefix caching.

    The encoder output depends on the request's own input (audio, image), not
    on a token prefix, so there is nothing to share. The coordinator passes
    `num_encoder_tokens` as the token count: blocks are allocated on the first
    schedule and not grown during decoding.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
    ) -> None:
        if not isinstance(kv_cache_spec, CrossAttentionSpec):
            raise ValueError(
                f"CrossAttentionManager needs a CrossAttentionSpec, got {kv_cache_spec}"
            )
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id)

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        if new_computed_blocks:
            raise ValueError("cross-attention blocks cannot come from the prefix cache")

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Nothing to cache: encoder outputs are per request."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        alignment_tokens: int,
    ) -> tuple[list[KVCacheBlock], ...]:
        # No hit ever: in a hybrid model this turns prefix caching off, as it must
        # for encoder-decoder models.
        return tuple([] for _ in kv_cache_group_ids)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        self.get_blocks(running_request_id)
        return 0
