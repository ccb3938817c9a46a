"""The paged KV cache layout, documented in one place.

Per attention layer there is ONE tensor::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]
    kv_cache[0] = key_cache    [num_blocks, block_size, num_kv_heads, head_size]
    kv_cache[1] = value_cache  [num_blocks, block_size, num_kv_heads, head_size]

Why this order: a decode step reads, for one request and one KV head, every
token of every block in its block table. With ``head_size`` innermost and the
heads of one token adjacent, a tile of ``BLOCK_N`` tokens of one head is
``BLOCK_N`` runs of ``head_size`` contiguous elements (128-512 bytes each), which
coalesces well; a whole block (all heads) is one contiguous span, which is what
block copies (offloading, prefix-cache moves) want. K and V live in one tensor
so a layer's cache is a single allocation and a block id means the same thing
for both halves.

A *slot* is a token position in the cache: ``slot = block_id * block_size +
offset_in_block``. ``PAD_SLOT_ID`` (-1) marks padded tokens whose K/V must not
be written.
"""

from __future__ import annotations

import torch

__all__ = [
    "PAD_SLOT_ID",
    "kv_cache_shape",
    "slot_mapping_from_block_table",
    "split_kv_cache",
]

PAD_SLOT_ID = -1


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, ...]:
    """Shape of one layer's combined cache: ``(2, N, block_size, num_kv_heads, head_size)``."""
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(key_cache, value_cache)`` of a combined ``[2, N, B, Hkv, D]`` cache (no copy)."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, head_size], "
            f"got {tuple(kv_cache.shape)}"
        )
    return kv_cache[0], kv_cache[1]


def slot_mapping_from_block_table(
    block_table: torch.Tensor,
    positions: torch.Tensor,
    request_indices: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Slots ``[T] int64`` for tokens at ``positions[t]`` of request ``request_indices[t]``.

    ``block_table [R, M]`` maps a request's logical block ``position // block_size`` to a
    physical block id. A negative position yields ``PAD_SLOT_ID``.
    """
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [R, M], got {tuple(block_table.shape)}")
    if positions.dim() != 1 or request_indices.shape != positions.shape:
        raise ValueError(
            "positions and request_indices must be 1-D of equal length, got "
            f"{tuple(positions.shape)} and {tuple(request_indices.shape)}"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    pos = positions.to(torch.int64)
    valid = pos >= 0
    safe = torch.where(valid, pos, torch.zeros_like(pos))
    block_ids = block_table.to(torch.int64)[request_indices.to(torch.int64), safe // block_size]
    slots = block_ids * block_size + safe % block_size
    return torch.where(valid, slots, torch.full_like(slots, PAD_SLOT_ID))
