"""Identifier types for blocks and block hashes.

`BlockHash` and `BlockHashWithGroupId` are `NewType`s over `bytes` rather than
tuples or dataclasses: bytes hash and compare in C, are immutable, and cost a
single allocation, which matters because every prefix lookup builds one key per
block. The group id is packed as 4 big-endian bytes after the hash so that the
same token prefix can be cached independently by each KV cache group.
"""

from __future__ import annotations

from typing import NewType

BlockId = NewType("BlockId", int)
"""Index of a physical block in the pool (block 0 is the null block)."""

BlockHash = NewType("BlockHash", bytes)
"""Hash of a block's tokens chained with its parent's hash and extra keys."""

BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
"""`BlockHash` followed by the KV cache group id as 4 big-endian bytes."""

_GROUP_ID_BYTES = 4
_MAX_GROUP_ID = (1 << (8 * _GROUP_ID_BYTES)) - 1

# Suffixes for the first groups, precomputed so the hot lookup path concatenates
# two existing bytes objects instead of calling int.to_bytes every time.
_GROUP_SUFFIXES: tuple[bytes, ...] = tuple(i.to_bytes(_GROUP_ID_BYTES, "big") for i in range(64))


def group_id_suffix(group_id: int) -> bytes:
    """The 4-byte big-endian encoding of `group_id` used in `BlockHashWithGroupId`."""
    if 0 <= group_id < len(_GROUP_SUFFIXES):
        return _GROUP_SUFFIXES[group_id]
    if not 0 <= group_id <= _MAX_GROUP_ID:
        raise ValueError(f"group_id must be in [0, {_MAX_GROUP_ID}], got {group_id}")
    return group_id.to_bytes(_GROUP_ID_BYTES, "big")


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Pack `block_hash` and `group_id` into one bytes key."""
    return BlockHashWithGroupId(block_hash + group_id_suffix(group_id))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The `BlockHash` part of a packed key."""
    return BlockHash(key[:-_GROUP_ID_BYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The group id part of a packed key."""
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big")
