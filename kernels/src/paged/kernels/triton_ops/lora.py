"""Triton LoRA shrink/expand, SGMV style (Punica): programs over slot-sorted row segments.

Rows are sorted by adapter slot once per step (``paged.kernels.lora.group_lora_rows``);
each program takes up to ``LORA_BLOCK_T`` rows of ONE slot and one output tile, so
it loads that slot's A/B tile once for all its rows and uses ``tl.dot``. A decode
step (one row per request) degenerates to BGMV: one program per row and tile.
Rows with slot -1 belong to no segment: shrink leaves them zero, expand untouched.

Precision: both operands in one 16-bit dtype -> ``tl.dot`` on them (products are
exact in float32, accumulation float32); otherwise (float32, or float32
activations meeting 16-bit adapter weights) both are upcast and the dot runs in
IEEE float32 (no TF32), so float32 matches the reference to rounding.
"""

# @triton.jit functions are untyped (triton ships no types; its JIT reads the
# parameter annotations itself), so these two checks are off in this file only.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels.lora import (
    LORA_BLOCK_T,
    LoRARowGroups,
    check_lora_expand,
    check_lora_groups,
    check_lora_shrink,
    group_lora_rows,
)
from paged.kernels.triton_ops._common import (
    check_last_dim_contiguous,
    check_triton_device,
    next_power_of_2,
)

__all__ = ["lora_expand", "lora_shrink"]

_BLOCK_K = 64  # reduction tile over in_features (shrink)
_MAX_TILE = 64  # output tile cap: rank tile (shrink), out_features tile (expand)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, IN]
    a_ptr,  # [S, R, IN]
    y_ptr,  # [T, R] contiguous, zero-filled
    order_ptr,  # [A] int64: rows sorted by slot
    block_slot_ptr,  # [NB] int32
    block_start_ptr,  # [NB] int32
    block_end_ptr,  # [NB] int32
    in_features,
    rank,
    stride_xt,
    stride_as,
    stride_ar,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    start = tl.load(block_start_ptr + block)
    end = tl.load(block_end_ptr + block)
    idx = start + tl.arange(0, BLOCK_T)
    t_mask = idx < end
    rows = tl.load(order_ptr + idx, mask=t_mask, other=0).to(tl.int64)
    r_mask = r < rank
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + k[None, :],
            mask=t_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # fmt: skip  [BLOCK_T, BLOCK_K]
        a = tl.load(
            a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
            mask=k_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # fmt: skip  [BLOCK_K, BLOCK_R] = A[slot]^T tile
        if NATIVE_DOT:
            acc += tl.dot(x, a)
        else:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    y_ptrs = y_ptr + rows[:, None] * rank + r[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=t_mask[:, None] & r_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, R]
    b_ptr,  # [S, N, R]
    out_ptr,  # [T, M], columns out_offset.. updated in place
    scaling_ptr,  # [S] float32
    order_ptr,
    block_slot_ptr,
    block_start_ptr,
    block_end_ptr,
    out_features,
    rank,
    out_offset,
    stride_yt,
    stride_bs,
    stride_bn,
    stride_ot,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(block_slot_ptr + block).to(tl.int64)
    start = tl.load(block_start_ptr + block)
    end = tl.load(block_end_ptr + block)
    idx = start + tl.arange(0, BLOCK_T)
    t_mask = idx < end
    rows = tl.load(order_ptr + idx, mask=t_mask, other=0).to(tl.int64)
    n_mask = n < out_features
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rank
        y = tl.load(
            y_ptr + rows[:, None] * stride_yt + r[None, :],
            mask=t_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # fmt: skip  [BLOCK_T, BLOCK_R]
        b = tl.load(
            b_ptr + slot * stride_bs + n[None, :] * stride_bn + r[:, None],
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # fmt: skip  [BLOCK_R, BLOCK_N] = B[slot]^T tile
        if NATIVE_DOT:
            acc += tl.dot(y, b)
        else:
            acc += tl.dot(y.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    acc = acc * tl.load(scaling_ptr + slot)
    o_ptrs = out_ptr + rows[:, None] * stride_ot + out_offset + n[None, :]
    o_mask = t_mask[:, None] & n_mask[None, :]
    current = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (current + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


def _native_dot(p: torch.Tensor, q: torch.Tensor) -> bool:
    return p.dtype == q.dtype and p.dtype in (torch.float16, torch.bfloat16)


def _tile(n: int) -> int:
    return min(_MAX_TILE, max(16, next_power_of_2(n)))  # tl.dot: every dim >= 16


def _groups_for(
    groups: LoRARowGroups | None, token_slots: torch.Tensor, num_slots: int, device: torch.device
) -> LoRARowGroups:
    if groups is None:
        groups = group_lora_rows(token_slots)
        check_lora_groups(groups, token_slots, num_slots, device)
    return groups


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, R, in]
    token_slots: torch.Tensor,  # [T] int32/int64, -1 = no adapter
    *,
    groups: LoRARowGroups | None = None,
) -> torch.Tensor:  # [T, R], dtype of x
    """``y[t] = lora_a[slot[t]] @ x[t]``; rows with slot -1 are zero."""
    check_lora_shrink(x, lora_a, token_slots, groups)
    check_triton_device(x=x, lora_a=lora_a)
    check_last_dim_contiguous(x=x, lora_a=lora_a)
    g = _groups_for(groups, token_slots, lora_a.shape[0], x.device)
    rank = lora_a.shape[1]
    y = torch.zeros(x.shape[0], rank, dtype=x.dtype, device=x.device)
    if g.num_blocks and rank:
        block_r = _tile(rank)
        _lora_shrink_kernel[(g.num_blocks, triton.cdiv(rank, block_r))](
            x, lora_a, y, g.order, g.block_slot, g.block_start, g.block_end,
            x.shape[1], rank, x.stride(0), lora_a.stride(0), lora_a.stride(1),
            BLOCK_T=LORA_BLOCK_T, BLOCK_R=block_r, BLOCK_K=_BLOCK_K,
            NATIVE_DOT=_native_dot(x, lora_a),
        )  # fmt: skip
    return y


def lora_expand(
    y: torch.Tensor,  # [T, R]
    lora_b: torch.Tensor,  # [S, N, R]
    token_slots: torch.Tensor,  # [T] int32/int64, -1 = no adapter
    out: torch.Tensor,  # [T, M], updated in place
    out_offset: int,
    scaling: torch.Tensor,  # [S] float32
    *,
    groups: LoRARowGroups | None = None,
) -> None:
    """``out[t, off:off+N] += scaling[slot[t]] * (lora_b[slot[t]] @ y[t])``; slot -1 untouched."""
    check_lora_expand(y, lora_b, token_slots, out, out_offset, scaling, groups)
    check_triton_device(y=y, lora_b=lora_b, out=out, scaling=scaling)
    check_last_dim_contiguous(y=y, lora_b=lora_b, out=out, scaling=scaling)
    g = _groups_for(groups, token_slots, lora_b.shape[0], y.device)
    out_features, rank = lora_b.shape[1], lora_b.shape[2]
    if g.num_blocks and out_features:
        block_n = _tile(out_features)
        _lora_expand_kernel[(g.num_blocks, triton.cdiv(out_features, block_n))](
            y, lora_b, out, scaling, g.order, g.block_slot, g.block_start, g.block_end,
            out_features, rank, out_offset, y.stride(0), lora_b.stride(0), lora_b.stride(1),
            out.stride(0),
            BLOCK_T=LORA_BLOCK_T, BLOCK_N=block_n, BLOCK_R=_tile(rank),
            NATIVE_DOT=_native_dot(y, lora_b),
        )  # fmt: skip
