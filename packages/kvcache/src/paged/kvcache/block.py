"""`KVCacheBlock`: CPU-side metadata of one physical KV cache block."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged.kvcache.errors import BlockStateError
from paged.kvcache.ids import BlockHashWithGroupId


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one block; the KV data itself lives in the runner's tensors.

    Lifecycle: allocated by `BlockPool.get_new_blocks` (ref_cnt 1), hashed once
    by `cache_full_blocks` when it becomes full, shared through `touch`
    (ref_cnt += 1), returned to the free queue when ref_cnt reaches 0 (its hash
    stays, so it can still be hit), and evicted (hash cleared) only when it is
    handed out again. `block_hash` may be set once; only `reset_hash()` clears
    it, so a hash can never be silently overwritten.

    `prev_free_block` / `next_free_block` are the intrusive links of
    `FreeKVCacheBlockQueue`; both are None exactly when the block is not in the
    queue. Equality is identity (`eq=False`): comparing links recursively would
    be both slow and meaningless.
    """

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = field(default=None, init=False)
    prev_free_block: KVCacheBlock | None = field(default=None, init=False)
    next_free_block: KVCacheBlock | None = field(default=None, init=False)
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        """The packed hash under which this block is cached, or None."""
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        if self._block_hash is not None:
            raise BlockStateError(
                f"block {self.block_id} already has a hash; call reset_hash() before re-hashing"
            )
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash (on eviction or prefix-cache reset)."""
        self._block_hash = None

    def __repr__(self) -> str:
        # Print neighbour ids only: the default repr would recurse along the list.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self._block_hash!r}, is_null={self.is_null}, "
            f"prev_free_block={prev_id}, next_free_block={next_id})"
        )
