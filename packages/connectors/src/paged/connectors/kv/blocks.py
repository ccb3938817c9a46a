"""Token-level views of the paged KV cache: slot mappings, gather and scatter.

A layer's cache is `[2, num_blocks, block_size, num_kv_heads, head_size]`
(K then V). Token t of a request lives in slot `block_ids[t // B] * B + t % B`:

    block_ids [7, 2]   B = 4
    tokens     0 1 2 3 | 4 5 6 7
    slots     28 ... 31 | 8 ... 11

Gathered KV is `[2, num_tokens, num_kv_heads, head_size]`, the unit a store holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slot_mapping(
    block_ids: Sequence[int], block_size: int, num_tokens: int, device: torch.device
) -> torch.Tensor:
    """Slots of the first `num_tokens` tokens of a request with these blocks (int64)."""
    if num_tokens > len(block_ids) * block_size:
        raise ValueError(
            f"{num_tokens} tokens do not fit in {len(block_ids)} blocks of {block_size}"
        )
    blocks = torch.tensor(list(block_ids), dtype=torch.int64, device=device)
    offsets = torch.arange(block_size, dtype=torch.int64, device=device)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:num_tokens]


def _flat(kv_layer: torch.Tensor) -> torch.Tensor:
    if kv_layer.dim() != 5 or kv_layer.shape[0] != 2:
        raise ValueError(
            "kv_layer must be [2, num_blocks, block_size, num_kv_heads, head_size], "
            f"got {tuple(kv_layer.shape)}"
        )
    two, blocks, size, heads, dim = kv_layer.shape
    return kv_layer.view(two, blocks * size, heads, dim)


def gather_kv(kv_layer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The K and V of these slots, `[2, len(slots), num_kv_heads, head_size]` (a copy)."""
    return _flat(kv_layer).index_select(1, slots.to(kv_layer.device))


def scatter_kv(kv_layer: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Write gathered `kv` back into these slots of the paged cache, in place."""
    flat = _flat(kv_layer)
    expected = (2, int(slots.shape[0]), flat.shape[2], flat.shape[3])
    if tuple(kv.shape) != expected:
        raise ValueError(f"kv has shape {tuple(kv.shape)}, the cache expects {expected}")
    if kv.dtype != flat.dtype:
        raise ValueError(f"kv has dtype {kv.dtype}, the cache holds {flat.dtype}")
    flat.index_copy_(1, slots.to(kv_layer.device), kv.to(kv_layer.device))
