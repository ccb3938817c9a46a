"""`MambaManager`: state-space layers keep only the latest state.

A mamba block holds the recurrent state after one token, not K/V per token:
the model writes the state after a step's *last* token only. So a block may
enter the prefix cache only when that token ends it; a block that a step
merely passed through never held "the state after its last token".

"align" mode (vLLM's `mamba_cache_mode="align"`), one request's blocks:

    position:  0      1      2      3      4      5
             | null | null | hit  | null | null | new  |
                            ^ state the step starts from (freed next step)
                                                  ^ state after the step's last
                                                    token; cached iff that token
                                                    ends block 5

Each step allocates one block, at the position of its last token (null
blocks pad the positions it skips, so block position i still covers tokens
[i * block_size, (i + 1) * block_size)); the runner copies the previous state
into it. The block the step started from is freed at the next step.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.block_pool import BlockPool
from paged.kvcache.ids import BlockHash, BlockHashWithGroupId
from paged.kvcache.managers.base import SingleTypeKVCacheManager
from paged.kvcache.protocols import KVCacheRequest
from paged.kvcache.specs import KVCacheSpec, MambaSpec, cdiv


class MambaManager(SingleTypeKVCacheManager):
    """A block holds the recurrent state after its last token.

    The state is cumulative, so only the block holding the state at the last
    computed token is needed: every earlier block is skipped (freed, replaced
    by the null block). A cached block's state summarises its whole prefix, so
    one hit, the rightmost, is enough. Prefix caching needs "align" mode (see
    the module docstring) or "all" (vLLM's: blocks are allocated and cached
    like attention blocks, which is right only when the model's kernels write
    the state at every block boundary); "none" allocates like "all" and
    refuses prefix caching.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
    ) -> None:
        if not isinstance(kv_cache_spec, MambaSpec):
            raise ValueError(f"MambaManager needs a MambaSpec, got {kv_cache_spec}")
        mode = kv_cache_spec.mamba_cache_mode
        if enable_caching and mode == "none":
            # Caching would register blocks whose state was never written.
            raise ValueError(
                "prefix caching with mamba layers needs MambaSpec(mamba_cache_mode='align') "
                "(or 'all' with kernels that write every block's state), got "
                "mamba_cache_mode='none'; set it, or disable prefix caching"
            )
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id)
        self.align = mode == "align"
        # Per request: positions below this hold only null blocks (align mode
        # leaves gaps, so remove_skipped_blocks cannot stop at the first null).
        self._first_live_block: dict[str, int] = {}
        # Blocks cached during the current step: their state is written by the
        # step itself, so no request may start from them before it has run.
        self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)

    # ------------------------------------------------------------ allocation
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        if new_computed_blocks and (
            new_computed_blocks[-1].block_hash in self.cached_blocks_this_step
        ):
            # vLLM's rule: more than the pool holds, so the request waits a step.
            return self.block_pool.num_gpu_blocks + 1
        if not self.align:
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                new_computed_blocks,
                total_computed_tokens,
                num_tokens_main_model,
            )
        # Lookahead (draft) tokens get no state block: they would break the
        # alignment, and draft models have no mamba layers (as in vLLM).
        bs = self.block_size
        num_required = cdiv(num_tokens_main_model, bs)
        req_blocks = self.req_to_blocks.get(request_id)
        num_held = 0 if req_blocks is None else len(req_blocks)
        if request_id in self.num_cached_block:  # running: at most the step's block
            return 1 if num_required > num_held else 0
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // bs
        covered = max(num_skipped_blocks, len(new_computed_blocks) + num_held)
        num_new = 0
        if cdiv(total_computed_tokens, bs) > covered:  # a block for external tokens
            num_new += 1
            covered = cdiv(total_computed_tokens, bs)
        if num_required > covered:
            num_new += 1
        first_kept = max(0, num_skipped_blocks - num_held)
        for blk in new_computed_blocks[first_kept:]:
            if blk.ref_cnt == 0 and not blk.is_null:
                num_new += 1
        return num_new

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Align mode: one block at the step's last token, nulls before it; returns both."""
        if not self.align:
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_required = cdiv(num_tokens_main_model, self.block_size)
        num_held = len(req_blocks)
        if num_required <= num_held:
            return []
        req_blocks.extend([self._null_block] * (num_required - 1 - num_held))
        req_blocks.extend(self.block_pool.get_new_blocks(1))
        # The nulls are returned too: the runner appends these ids to its block
        # table, which must stay position-aligned.
        return req_blocks[num_held:]

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        if not self.align:
            super().remove_skipped_blocks(request_id, total_computed_tokens)
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped_blocks = min(
            self.get_num_skipped_tokens(total_computed_tokens) // self.block_size, len(blocks)
        )
        start = self._first_live_block.get(request_id, 0)
        if num_skipped_blocks <= start:
            return
        null = self._null_block
        removed: list[KVCacheBlock] = []
        for i in range(num_skipped_blocks - 1, start - 1, -1):  # tail first, as in free()
            blk = blocks[i]
            if blk is not null:
                removed.append(blk)
                blocks[i] = null
        self._first_live_block[request_id] = num_skipped_blocks
        if removed:
            self.block_pool.free_blocks(removed)

    # --------------------------------------------------------------- caching
    def cache_blocks(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Align mode: cache only the block that token `num_tokens - 1` ends.

        `num_tokens` is the request's length after the step being allocated;
        its state lands in the block of its last token. Every earlier full
        block is marked done without caching: none of them will ever hold the
        state after its own last token.
        """
        if not self.align:
            super().cache_blocks(request, num_tokens)
            return
        request_id = request.request_id
        num_full_blocks = num_tokens // self.block_size
        if self.num_cached_block.get(request_id, 0) >= num_full_blocks:
            return
        blocks = self.req_to_blocks[request_id]
        last = blocks[num_full_blocks - 1]
        if num_tokens % self.block_size == 0 and not last.is_null:
            self.block_pool.cache_full_blocks(
                request=request,
                blocks=blocks,
                num_cached_blocks=num_full_blocks - 1,
                num_full_blocks=num_full_blocks,
                block_size=self.block_size,
                kv_cache_group_id=self.kv_cache_group_id,
            )
            if last.block_hash is not None:
                self.cached_blocks_this_step.add(last.block_hash)
        self.num_cached_block[request_id] = num_full_blocks

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()

    def free(self, request_id: str) -> None:
        self._first_live_block.pop(request_id, None)
        super().free(request_id)

    # ---------------------------------------------------------------- lookup
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
        block_size = kv_cache_spec.block_size
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for i in range(max_num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                continue
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens != 0:
                continue
            for lst, blk in zip(computed, cached, strict=True):
                # Hit length is len(blocks) * block_size: pad the prefix with nulls.
                lst.extend([block_pool.null_block] * i)
                lst.append(blk)
            break
        return computed

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        self.get_blocks(running_request_id)
        return 0
