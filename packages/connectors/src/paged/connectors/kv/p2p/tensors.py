"""Blocks of the paged KV cache as bytes and back (one layer at a time).

A layer's cache is `[2, num_blocks, B, H, D]`; the blocks of a transfer are
`cache[:, ids]`, `[2, n, B, H, D]`, sent as raw bytes in the cache's dtype
(the handshake made sure both sides mean the same thing by them).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch


def block_bytes(kv_layer: torch.Tensor) -> int:
    """Bytes of one block of one layer (K and V)."""
    return 2 * int(kv_layer[0, 0].numel()) * kv_layer.element_size()


def gather_blocks(kv_layer: torch.Tensor, block_ids: Sequence[int]) -> memoryview:
    """`kv_layer[:, block_ids]` as contiguous host bytes (a copy: the cache keeps changing)."""
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=kv_layer.device)
    blocks = kv_layer.index_select(1, index).cpu().contiguous()
    return memoryview(blocks.view(torch.uint8).reshape(-1).numpy().data)


def blocks_view(kv_layer: torch.Tensor, n: int, data: memoryview) -> torch.Tensor:
    """`n` blocks received as bytes, `[2, n, B, H, D]` in `kv_layer`'s dtype (no copy);
    `ValueError` if `data` is too short."""
    expected = n * block_bytes(kv_layer)
    if data.nbytes < expected:
        raise ValueError(f"{data.nbytes} bytes received for {n} blocks, expected {expected}")
    with warnings.catch_warnings():
        # The received buffer is read-only; it is only ever read (copied into the cache).
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(data, dtype=torch.uint8, count=expected)
    return raw.view(kv_layer.dtype).view(2, n, *kv_layer.shape[2:])


def scatter_blocks(kv_layer: torch.Tensor, block_ids: Sequence[int], data: memoryview) -> None:
    """Write `len(block_ids)` blocks received as bytes into these blocks of `kv_layer`."""
    n = len(block_ids)
    if n == 0:
        return
    blocks = blocks_view(kv_layer, n, data)
    index = torch.tensor(list(block_ids), dtype=torch.int64, device=kv_layer.device)
    kv_layer.index_copy_(1, index, blocks.to(kv_layer.device))
