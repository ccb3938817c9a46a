"""`BlockHashToBlockMap`: prefix-cache index from packed hash to cached blocks."""

from __future__ import annotations

from collections.abc import Iterator

from paged.kvcache.block import KVCacheBlock
from paged.kvcache.ids import BlockHashWithGroupId


class BlockHashToBlockMap:
    """Maps a `BlockHashWithGroupId` to the block(s) caching it.

    Almost every key has exactly one block, so a single block is stored
    directly and promoted to a `{block_id: block}` dict only when a second block
    with the same hash appears (which saves one dict per cached block). There is
    no de-duplication: two requests that computed the same block concurrently
    each keep their own copy, because a block id, once written into a request's
    block table, must never change (block tables are append-only).
    """

    __slots__ = ("_cache", "raw_get")

    def __init__(self) -> None:
        # Keyed by bytes (BlockHashWithGroupId values) so hot loops can probe
        # with a concatenation without wrapping it in the NewType.
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # `raw_get(key)` -> a block, a {block_id: block} dict, or None (bound dict.get).
        self.raw_get = self._cache.get

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """Any block cached under `key`, or None."""
        blocks = self._cache.get(key)
        if blocks is None or type(blocks) is KVCacheBlock:
            return blocks
        assert isinstance(blocks, dict)
        return next(iter(blocks.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        """Add `block` under `key` (promoting to a dict on the second block)."""
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif type(blocks) is KVCacheBlock:
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            assert isinstance(blocks, dict)
            blocks[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove and return the block `block_id` under `key`, or None if absent."""
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if type(blocks) is KVCacheBlock:
            if blocks.block_id != block_id:
                return None
            del self._cache[key]
            return blocks
        assert isinstance(blocks, dict)
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[key]
        return block

    def __len__(self) -> int:
        """Number of distinct keys."""
        return len(self._cache)

    def items(self) -> Iterator[tuple[bytes, KVCacheBlock]]:
        """Every (key, block) pair, one per cached block."""
        for key, blocks in self._cache.items():
            if type(blocks) is KVCacheBlock:
                yield key, blocks
            else:
                assert isinstance(blocks, dict)
                for block in blocks.values():
                    yield key, block

    def num_blocks(self) -> int:
        """Number of cached blocks (>= number of keys)."""
        return sum(1 if isinstance(b, KVCacheBlock) else len(b) for b in self._cache.values())
