"""Builders of random paged batches for tests and benchmarks (no test framework needed).

``make_paged_batch`` scatters each request's dense K/V into a cache through a
block table of *shuffled* block ids, so a kernel that ignores the table, or
reads the wrong block, gives a wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PagedBatch", "make_paged_batch"]


@dataclass(slots=True)
class PagedBatch:
    """A mixed batch ready for ``paged_attention``, plus the dense K/V it was built from."""

    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [N, B, Hkv, D]
    value_cache: torch.Tensor  # [N, B, Hkv, D]
    block_table: torch.Tensor  # [R, M] int32
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    dense_keys: list[torch.Tensor]  # R x [seq_len, Hkv, D]
    dense_values: list[torch.Tensor]  # R x [seq_len, Hkv, D]
    max_query_len: int
    max_seq_len: int


def make_paged_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    extra_blocks: int = 3,
    padding_tokens: int = 0,
    generator: torch.Generator | None = None,
) -> PagedBatch:
    """Random batch: request ``r`` has ``query_lens[r]`` new tokens out of ``seq_lens[r]``.

    ``extra_blocks`` unused cache blocks are filled with large garbage so reads of the
    wrong block show up; ``padding_tokens`` rows of garbage follow the last query.
    """
    if len(query_lens) != len(seq_lens):
        raise ValueError("query_lens and seq_lens must have the same length")
    if any(q < 0 or q > s for q, s in zip(query_lens, seq_lens, strict=True)):
        raise ValueError("need 0 <= query_lens[r] <= seq_lens[r]")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + extra_blocks
    max_blocks = max([*blocks_per_req, 1])
    perm = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen) * 100  # garbage where nothing is written
    value_cache = torch.randn(shape, generator=gen) * 100
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    dense_keys, dense_values = [], []
    next_block = 0
    for r, seq_len in enumerate(seq_lens):
        ids = perm[next_block : next_block + blocks_per_req[r]]
        next_block += blocks_per_req[r]
        block_table[r, : len(ids)] = ids.to(torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        for j, block_id in enumerate(ids.tolist()):
            chunk = slice(j * block_size, min((j + 1) * block_size, seq_len))
            n = chunk.stop - chunk.start
            key_cache[block_id, :n] = k[chunk]
            value_cache[block_id, :n] = v[chunk]
        dense_keys.append(k.to(dtype=dtype, device=device))
        dense_values.append(v.to(dtype=dtype, device=device))
    num_tokens = sum(query_lens) + padding_tokens
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen)
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(list(query_lens), dtype=torch.int32), 0)
    return PagedBatch(
        query=query.to(dtype=dtype, device=device),
        key_cache=key_cache.to(dtype=dtype, device=device),
        value_cache=value_cache.to(dtype=dtype, device=device),
        block_table=block_table.to(device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        dense_keys=dense_keys,
        dense_values=dense_values,
        max_query_len=max([*query_lens, 0]),
        max_seq_len=max([*seq_lens, 0]),
    )
