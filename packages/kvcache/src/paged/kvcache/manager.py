"""`KVCacheManager`: the scheduler-facing API, and `KVCacheBlocks`, its only boundary object."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.config import KVCacheConfig
from paged.kvcache.coordinator import get_kv_cache_coordinator
from paged.kvcache.errors import KVCacheIntegrityError, UnknownRequestError
from paged.kvcache.events import BlockStored, KVCacheEvent
from paged.kvcache.managers.full_attention import FullAttentionManager
from paged.kvcache.managers.sink import SinkFullAttentionManager
from paged.kvcache.metrics import KVCacheMetricsCollector
from paged.kvcache.protocols import KVCacheRequest
from paged.kvcache.specs import kv_cache_spec_kind, kv_cache_spec_sliding_window
from paged.kvcache.stats import PrefixCacheStats


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks per KV cache group: `blocks[i][j]` is block j of group i.

    The interface between the scheduler and `KVCacheManager`: the scheduler
    reads block ids from it and passes it back (prefix hits) but never touches
    the blocks themselves.
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple(
                list(itertools.chain(a, b)) for a, b in zip(self.blocks, other.blocks, strict=True)
            )
        )

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group (null blocks appear as id 0)."""
        return tuple([blk.block_id for blk in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of single-group blocks not (yet) in the prefix cache."""
        if len(self.blocks) != 1:
            raise ValueError("get_unhashed_block_ids() needs exactly one KV cache group")
        return [blk.block_id for blk in self.blocks[0] if blk.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.blocks))

    def __len__(self) -> int:
        """Blocks in the first group (all groups hold the same count of positions)."""
        return len(self.blocks[0]) if self.blocks else 0


class KVCacheManager:
    """Allocates KV cache blocks to requests and serves prefix-cache hits.

    Typical use by a scheduler step, for a new request:

        hits, num_hit_tokens = kvm.get_computed_blocks(request)
        new = kvm.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
        if new is None: ... cannot schedule (or preempt) ...
        block_ids = kvm.get_block_ids(request.request_id)

    and for a running request `allocate_slots(request, num_new_tokens)`; when it
    finishes or is preempted, `free(request)`.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        hash_block_size: int | None = None,
        enable_kv_cache_events: bool = False,
        log_stats: bool = False,
        use_eagle: bool = False,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        if hash_block_size is None:
            hash_block_size = min(block_sizes)
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            hash_block_size,
            metrics_collector,
        )
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        self.kv_cache_config = kv_cache_config
        # (kind, sliding window) per group, stamped on BlockStored events.
        self.kv_cache_event_metadata: tuple[tuple[str, int | None], ...] = tuple(
            (kv_cache_spec_kind(g.kv_cache_spec), kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups
        )
        # Shared empty result: returning it allocates nothing (GC pressure).
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        # One full-attention group: running requests take `_allocate_running_full`,
        # which does what the five stages do for that case with fewer calls.
        # Tests set it to None to compare both paths.
        managers = self.coordinator.single_type_managers
        self._fast_full_manager: FullAttentionManager | None = None
        # Exact types only: a subclass may override a stage the fast path skips.
        if (
            len(managers) == 1
            and isinstance(managers[0], FullAttentionManager)
            and type(managers[0]) in (FullAttentionManager, SinkFullAttentionManager)
        ):
            self._fast_full_manager = managers[0]

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (0.0 .. 1.0)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Stats since the last call (None unless `log_stats`), then start afresh."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    # ----------------------------------------------------------------- lookup
    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of `request`: (blocks, number of hit tokens).

        Takes no reference: pass the blocks to `allocate_slots` in the same
        step. At most `num_tokens - 1` tokens hit, since the last token must go
        through the model to produce logits. No lookup when caching is off or
        the request sets `skip_reading_prefix_cache` (prompt logprobs).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks, num_new_computed_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        stats = self.prefix_cache_stats
        if stats is not None:
            preempted = getattr(request, "num_preemptions", 0) > 0
            stats.record(request.num_tokens, num_new_computed_tokens, preempted)
        return self.create_kv_cache_blocks(computed_blocks), num_new_computed_tokens

    # ------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Add slots for `num_new_tokens` tokens; return the new blocks or None.

        Token layout of the request after this call:

            | computed | new_computed | ext_computed |   new   | lookahead |
            |<------------ already computed ---------->|<- to compute ->|
                                   |<------- allocated in this call -------->|

        Stages: (1) free blocks that left the attention window (happens even
        when the call then fails); (2) capacity check, returning None with
        nothing else changed when blocks are short; (3) adopt the prefix hits;
        (4) allocate new blocks; (5) cache the blocks that the new tokens
        fill (unless caching is off or `delay_cache_blocks`). Lookahead (draft)
        tokens get slots but are never cached.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 (or external tokens given)")
        if num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                "num_new_computed_tokens and num_lookahead_tokens must be >= 0, got "
                f"{num_new_computed_tokens} and {num_lookahead_tokens}"
            )
        if num_external_computed_tokens < 0 or num_encoder_tokens < 0:
            raise ValueError(
                "num_external_computed_tokens and num_encoder_tokens must be >= 0, got "
                f"{num_external_computed_tokens} and {num_encoder_tokens}"
            )
        if new_computed_blocks is None:
            fast = self._fast_full_manager
            if (
                fast is not None
                and num_external_computed_tokens == 0
                and num_encoder_tokens == 0
                and request.request_id in fast.req_to_blocks
            ):
                return self._allocate_running_full(
                    fast,
                    request,
                    num_new_tokens,
                    num_new_computed_tokens,
                    num_lookahead_tokens,
                    delay_cache_blocks,
                )
            new_computed_block_list = self.empty_kv_cache_blocks.blocks
        else:
            new_computed_block_list = new_computed_blocks.blocks
            if len(new_computed_block_list) != self.num_kv_cache_groups:
                raise ValueError(
                    f"new_computed_blocks has {len(new_computed_block_list)} groups, "
                    f"expected {self.num_kv_cache_groups}"
                )
        request_id = request.request_id
        coordinator = self.coordinator
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(
            num_local_computed_tokens + num_external_computed_tokens, self.max_model_len
        )
        num_tokens_main_model = total_computed_tokens + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)

        # Stage 1: free blocks outside the attention window.
        coordinator.remove_skipped_blocks(request_id, total_computed_tokens)
        # Stage 2: capacity.
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens_need_slot,
            new_computed_block_list,
            num_encoder_tokens,
            num_local_computed_tokens + num_external_computed_tokens,
            num_tokens_main_model,
        )
        if num_blocks_to_allocate > self.block_pool.free_block_queue.num_free_blocks:
            return None
        # Stage 3: prefix hits (and slots for externally computed tokens).
        if (
            new_computed_block_list is not self.empty_kv_cache_blocks.blocks
            or num_external_computed_tokens > 0
        ):
            coordinator.allocate_new_computed_blocks(
                request_id,
                new_computed_block_list,
                num_local_computed_tokens,
                num_external_computed_tokens,
            )
        # Stage 4: new blocks.
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, num_tokens_main_model, num_encoder_tokens
        )
        # Stage 5: cache full blocks, as soon as their slots exist. Draft tokens
        # may be rejected, so never cache beyond the request's real tokens.
        if self.enable_caching and not delay_cache_blocks:
            num_tokens_to_cache = min(total_computed_tokens + num_new_tokens, request.num_tokens)
            coordinator.cache_blocks(request, num_tokens_to_cache)
        return self.create_kv_cache_blocks(new_blocks)

    def _allocate_running_full(
        self,
        manager: FullAttentionManager,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> KVCacheBlocks | None:
        """`allocate_slots` for a request already holding blocks, one full-attention group.

        Full attention skips nothing (stage 1 is a no-op) and a running request
        has no new hits (stage 3 is a no-op), so what is left is: blocks
        needed minus blocks held, then caching newly full blocks.
        """
        request_id = request.request_id
        req_blocks = manager.req_to_blocks[request_id]
        max_model_len = self.max_model_len
        total_computed_tokens = min(
            request.num_computed_tokens + num_new_computed_tokens, max_model_len
        )
        num_tokens_need_slot = min(
            total_computed_tokens + num_new_tokens + num_lookahead_tokens, max_model_len
        )
        block_size = manager.block_size
        num_new_blocks = (num_tokens_need_slot + block_size - 1) // block_size - len(req_blocks)
        result = self.empty_kv_cache_blocks
        if num_new_blocks > 0:
            pool = self.block_pool
            if num_new_blocks > pool.free_block_queue.num_free_blocks:
                return None
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            result = KVCacheBlocks((new_blocks,))
        if self.enable_caching and not delay_cache_blocks:
            num_tokens_to_cache = total_computed_tokens + num_new_tokens
            if num_tokens_to_cache > request.num_tokens:
                num_tokens_to_cache = request.num_tokens
            if num_tokens_to_cache // block_size > manager.num_cached_block.get(request_id, 0):
                manager.cache_blocks(request, num_tokens_to_cache)
        return result

    def new_step_starts(self) -> None:
        """Call once at the start of every scheduling step, before any `allocate_slots`.

        Mamba groups cache a block when the step that writes its state is
        allocated; until that step has run, no other request may start from
        it (`allocate_slots` returns None for such a request, which then waits
        a step, as in vLLM). Without this call those blocks stay unusable.
        """
        self.coordinator.new_step_starts()

    def free(self, request: KVCacheRequest) -> None:
        """Release all blocks of `request` (a no-op if it holds none)."""
        self.coordinator.free(request.request_id)

    def cache_blocks(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """Cache the full blocks of the first `num_computed_tokens` tokens (after a delay)."""
        if num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
        self._require_request(request.request_id)
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    # ---------------------------------------------------------------- queries
    def _require_request(self, request_id: str) -> None:
        if not self.coordinator.has_request(request_id):
            raise UnknownRequestError(f"request_id {request_id!r} holds no KV cache blocks")

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The blocks of a request that holds blocks (else `UnknownRequestError`)."""
        self._require_request(request_id)
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Block ids per group of a request that holds blocks."""
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, leading blocks shared by all live requests (cascade attention)."""
        self._require_request(running_request_id)
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        # Return the shared empty instance when there is nothing (fewer objects).
        for group in blocks:
            if group:
                return KVCacheBlocks(blocks)
        return self.empty_kv_cache_blocks

    def create_empty_block_list(self) -> KVCacheBlocks:
        """A fresh empty `KVCacheBlocks` with one list per group."""
        return KVCacheBlocks(tuple([] for _ in range(self.num_kv_cache_groups)))

    # ------------------------------------------------------------ maintenance
    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (nothing changed) while blocks are in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cached hashes of `block_ids` (see `BlockPool.evict_blocks`)."""
        self.block_pool.evict_blocks(block_ids)

    def take_events(self) -> list[KVCacheEvent]:
        """Pending KV cache events (empty unless `enable_kv_cache_events`).

        Each `BlockStored` gets its group's spec kind and sliding window here,
        not in the pool, which knows blocks, not specs (vLLM 0.33.0 does the
        same in KVCacheManager.take_events, kv_cache_manager.py:705-730).
        """
        events = self.block_pool.take_events()
        meta = self.kv_cache_event_metadata
        for i, e in enumerate(events):
            if isinstance(e, BlockStored) and e.group_idx is not None and e.group_idx < len(meta):
                kind, window = meta[e.group_idx]
                events[i] = dataclasses.replace(
                    e, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window
                )
        return events

    def check_integrity(self) -> None:
        """Pool invariants plus: each block's ref_cnt equals its holders (O(n))."""
        pool = self.block_pool
        pool.check_integrity()
        holders = [0] * pool.num_gpu_blocks
        for manager in self.coordinator.single_type_managers:
            for blocks in manager.req_to_blocks.values():
                for blk in blocks:
                    holders[blk.block_id] += 1
            for blk in getattr(manager, "sink_blocks", ()):
                holders[blk.block_id] += 1
            for rid, n in manager.num_cached_block.items():
                held = manager.req_to_blocks.get(rid)
                if held is None or n > len(held):
                    raise KVCacheIntegrityError(
                        f"request {rid!r} has {n} cached blocks but holds "
                        f"{0 if held is None else len(held)}"
                    )
        for blk in pool.blocks[1:]:
            if blk.ref_cnt != holders[blk.block_id]:
                raise KVCacheIntegrityError(
                    f"block {blk.block_id} has ref_cnt {blk.ref_cnt} but "
                    f"{holders[blk.block_id]} holders"
                )


__all__ = ["KVCacheBlocks", "KVCacheManager"]
