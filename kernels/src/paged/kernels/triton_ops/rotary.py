"""Triton rotary embedding (NeoX and GPT-J styles, partial rotary)."""

# @triton.jit functions are untyped (triton ships no types; its JIT reads the
# parameter annotations itself), so these two checks are off in this file only.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels.triton_ops._common import (
    check_last_dim_contiguous,
    check_triton_device,
    next_power_of_2,
)
from paged.kernels.validation import check_rotary

__all__ = ["rotary_embedding"]


@triton.jit
def _rotate_heads(
    x_ptr,  # [T, H * D] contiguous, rotated in place
    row,
    cos,  # [1, HALF_PAD] float32
    sin,
    num_heads,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    h = tl.arange(0, H_PAD)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (j < HALF)
    if IS_NEOX:  # pairs (j, j + HALF)
        first = j
        second = j + HALF
    else:  # pairs (2j, 2j + 1)
        first = 2 * j
        second = 2 * j + 1
    base = x_ptr + row * num_heads * HEAD_SIZE + h * HEAD_SIZE
    x1 = tl.load(base + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + first, x1 * cos - x2 * sin, mask=mask)
    tl.store(base + second, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T]
    q_ptr,  # [T, Hq * D] contiguous
    k_ptr,  # [T, Hkv * D] contiguous
    cache_ptr,  # [max_position, ROTARY_DIM] contiguous
    num_heads,
    num_kv_heads,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    IS_NEOX: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    # One program per token: rotate all its query and key heads.
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    j = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cache_ptr + pos * 2 * HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * 2 * HALF + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, row, cos, sin, num_heads, HEAD_SIZE, HALF, IS_NEOX, HQ_PAD, HALF_PAD)
    _rotate_heads(k_ptr, row, cos, sin, num_kv_heads, HEAD_SIZE, HALF, IS_NEOX, HKV_PAD, HALF_PAD)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq * D]
    key: torch.Tensor,  # [T, Hkv * D]
    head_size: int,
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos | sin
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` dims of every head; returns new ``(query, key)``.

    Inputs are not modified. Positions are not range-checked on the device (the
    reference raises for out-of-range positions).
    """
    check_rotary(positions, query, key, head_size, cos_sin_cache)
    check_triton_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    check_last_dim_contiguous(query=query, key=key)
    q_out = query.contiguous().clone()
    k_out = key.contiguous().clone()
    if positions.shape[0] == 0:
        return q_out, k_out
    num_heads = query.shape[1] // head_size
    num_kv_heads = key.shape[1] // head_size
    half = cos_sin_cache.shape[1] // 2
    _rotary_kernel[(positions.shape[0],)](
        positions.contiguous(), q_out, k_out, cos_sin_cache.contiguous(),
        num_heads, num_kv_heads,
        HEAD_SIZE=head_size, HALF=half, IS_NEOX=is_neox,
        HQ_PAD=next_power_of_2(num_heads), HKV_PAD=next_power_of_2(num_kv_heads),
        HALF_PAD=next_power_of_2(half),
    )  # fmt: skip
    return q_out, k_out
