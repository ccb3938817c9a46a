"""KV cache coordinators: fan requests out to one manager per KV cache group.

`get_kv_cache_coordinator` picks:
- `KVCacheCoordinatorNoPrefixCache` when prefix caching is off;
- `UnitaryKVCacheCoordinator` for one group;
- `HybridKVCacheCoordinator` for several groups (e.g. full + sliding window),
  whose prefix lookup iterates to a hit length every group accepts.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import replace

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.block_pool import BlockPool
from paged.kvcache.config import KVCacheConfig
from paged.kvcache.hashing import BlockHashListWithBlockSize
from paged.kvcache.ids import BlockHash
from paged.kvcache.managers.base import SingleTypeKVCacheManager
from paged.kvcache.managers.cross_attention import CrossAttentionManager
from paged.kvcache.managers.registry import get_manager_class, get_manager_for_kv_cache_spec
from paged.kvcache.metrics import KVCacheMetricsCollector
from paged.kvcache.protocols import KVCacheRequest
from paged.kvcache.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

GroupBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator(ABC):
    """Owns the block pool and one manager per group; prefix lookup in subclasses."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        hash_block_size: int,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.use_eagle = use_eagle
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        for group in kv_cache_config.kv_cache_groups:
            bs = group.kv_cache_spec.block_size
            if enable_caching and bs % hash_block_size != 0:
                raise ValueError(
                    f"block size {bs} of group {group.layer_names} is not a multiple of "
                    f"hash_block_size {hash_block_size}"
                )
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            metrics_collector,
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(g.kv_cache_spec, self.block_pool, enable_caching, i)
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        total = 0
        for i, manager in enumerate(self.single_type_managers):
            if isinstance(manager, CrossAttentionManager):
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, (), 0, num_encoder_tokens
                )
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    new_computed_blocks[i],
                    total_computed_tokens,
                    num_tokens_main_model,
                )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        for i, manager in enumerate(self.single_type_managers):
            manager.allocate_new_computed_blocks(
                request_id,
                new_computed_blocks[i],
                num_local_computed_tokens,
                num_external_computed_tokens,
            )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> GroupBlocks:
        return tuple(
            manager.allocate_new_blocks(request_id, num_encoder_tokens, num_encoder_tokens)
            if isinstance(manager, CrossAttentionManager)
            else manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            for manager in self.single_type_managers
        )

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def new_step_starts(self) -> None:
        for manager in self.single_type_managers:
            manager.new_step_starts()

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, total_computed_tokens)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [
            m.get_num_common_prefix_blocks(running_request_id) for m in self.single_type_managers
        ]

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(m.get_blocks(request_id) for m in self.single_type_managers)

    def has_request(self, request_id: str) -> bool:
        return any(request_id in m.req_to_blocks for m in self.single_type_managers)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[GroupBlocks, int]:
        """Longest prefix every group can serve from the cache: (blocks per group, tokens)."""


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching disabled: no lookup, nothing cached."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[GroupBlocks, int]:
        return tuple([] for _ in self.single_type_managers), 0

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        self.get_blocks(running_request_id)
        return [0] * len(self.single_type_managers)


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one group: the lookup is that manager's."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        hash_block_size: int,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        super().__init__(
            kv_cache_config,
            max_model_len,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            hash_block_size,
            metrics_collector,
        )
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[GroupBlocks, int]:
        if self.block_size != self.hash_block_size:
            block_hashes = BlockHashListWithBlockSize(
                block_hashes, self.hash_block_size, self.block_size
            )
        hit_blocks = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            (0,),
            self.block_pool,
            self.kv_cache_spec,
            self.use_eagle,
            self.block_size,
        )
        return hit_blocks, len(hit_blocks[0]) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups: find a hit length that every group can serve.

    Groups with equal specs form one "attention group" looked up together
    (all-or-nothing per block). Full attention goes first: it is downward
    closed, so later rounds only truncate its first answer. Each round lets
    every attention group shorten the candidate length; it stops when a round
    shortens nothing (hit lengths only decrease, so this terminates). With
    full attention plus one other type, one round suffices: the other type's
    answer is valid by itself and full attention accepts any shorter prefix.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        hash_block_size: int,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        super().__init__(
            kv_cache_config,
            max_model_len,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            hash_block_size,
            metrics_collector,
        )
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for i, group in enumerate(kv_cache_config.kv_cache_groups):
            by_spec.setdefault(group.kv_cache_spec, []).append(i)
        attention_groups = [(spec, ids, get_manager_class(spec)) for spec, ids in by_spec.items()]
        # Stable sort: full attention first, others in group order.
        attention_groups.sort(key=lambda g: not isinstance(g[0], FullAttentionSpec))
        self.attention_groups = attention_groups
        self.lcm_block_size = math.lcm(*(s.block_size for s, _, _ in attention_groups))
        self.is_simple_hybrid = len(attention_groups) == 2 and isinstance(
            attention_groups[0][0], FullAttentionSpec
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[GroupBlocks, int]:
        hit_blocks, hit_length = self._find_agreed_hit(block_hashes, max_cache_hit_length)
        if self.use_eagle and hit_length > 0:
            # EAGLE recomputes the last hit block to get its hidden states. The
            # groups agreed on a length with one extra block of history (see
            # `_lookup_spec`), so dropping one block once, for every group
            # together, keeps each group's answer valid (vLLM: one coordinated
            # drop, not one per group, which would lose two blocks).
            # One block of every group: the lcm keeps every group's list aligned.
            hit_length -= self.lcm_block_size
            for spec, group_ids, _ in self.attention_groups:
                for gid in group_ids:
                    del hit_blocks[gid][hit_length // spec.block_size :]
        return hit_blocks, hit_length

    def _lookup_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """The spec a lookup uses: with EAGLE, windows reach one block further back."""
        if self.use_eagle and isinstance(spec, SlidingWindowSpec):
            return replace(spec, sliding_window=spec.sliding_window + spec.block_size)
        if self.use_eagle and isinstance(spec, ChunkedLocalAttentionSpec):
            raise ValueError("chunked local attention does not support EAGLE")
        return spec

    def _find_agreed_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[GroupBlocks, int]:
        num_groups = len(self.single_type_managers)
        hit_blocks_by_group: list[list[KVCacheBlock] | None] = [None] * num_groups
        hit_length = max_cache_hit_length
        while True:
            curr_hit_length = hit_length
            for spec, group_ids, manager_cls in self.attention_groups:
                cached = hit_blocks_by_group[group_ids[0]]
                if isinstance(spec, FullAttentionSpec) and cached is not None:
                    num_blocks = curr_hit_length // spec.block_size
                    curr_hit_length = num_blocks * spec.block_size
                    for gid in group_ids:
                        blocks = hit_blocks_by_group[gid]
                        assert blocks is not None
                        del blocks[num_blocks:]
                    continue
                hashes: Sequence[BlockHash] = block_hashes
                if spec.block_size != self.hash_block_size:
                    hashes = BlockHashListWithBlockSize(
                        block_hashes, self.hash_block_size, spec.block_size
                    )
                hit = manager_cls.find_longest_cache_hit(
                    hashes,
                    curr_hit_length,
                    group_ids,
                    self.block_pool,
                    self._lookup_spec(spec),
                    False,  # the EAGLE drop happens once, in find_longest_cache_hit
                    self.lcm_block_size,
                )
                curr_hit_length = len(hit[0]) * spec.block_size
                for gid, blocks in zip(group_ids, hit, strict=True):
                    hit_blocks_by_group[gid] = blocks
            if curr_hit_length >= hit_length:
                break
            hit_length = curr_hit_length
            if self.is_simple_hybrid:
                break
        # Every group's list must cover exactly hit_length tokens.
        for spec, group_ids, _ in self.attention_groups:
            num_blocks = hit_length // spec.block_size
            for gid in group_ids:
                blocks = hit_blocks_by_group[gid]
                if blocks is not None:
                    del blocks[num_blocks:]
        return tuple(b if b is not None else [] for b in hit_blocks_by_group), hit_length


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    use_eagle: bool,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    hash_block_size: int,
    metrics_collector: KVCacheMetricsCollector | None = None,
) -> KVCacheCoordinator:
    """The coordinator for this configuration (see the module docstring)."""
    cls: type[KVCacheCoordinator]
    if not enable_caching:
        cls = KVCacheCoordinatorNoPrefixCache
    elif len(kv_cache_config.kv_cache_groups) == 1:
        cls = UnitaryKVCacheCoordinator
    else:
        cls = HybridKVCacheCoordinator
    return cls(
        kv_cache_config,
        max_model_len,
        use_eagle,
        enable_caching,
        enable_kv_cache_events,
        hash_block_size,
        metrics_collector,
    )
