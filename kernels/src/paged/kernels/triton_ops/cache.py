"""Triton ``reshape_and_cache`` and ``copy_blocks``."""

# @triton.jit functions are untyped (triton ships no types; its JIT reads the
# parameter annotations itself), so these two checks are off in this file only.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged.kernels import reference
from paged.kernels.kv_quant import fp8_max
from paged.kernels.triton_ops._common import (
    check_block_contiguous,
    check_last_dim_contiguous,
    check_triton_device,
    next_power_of_2,
)
from paged.kernels.validation import check_copy_blocks, check_reshape_and_cache

__all__ = ["copy_blocks", "reshape_and_cache"]

# fp8 cache dtype -> (mantissa bits, smallest normal value): the grid _round_to_fp8 rounds to.
_FP8_GRID: dict[torch.dtype, tuple[int, float]] = {
    torch.float8_e4m3fn: (3, 2.0**-6),
    torch.float8_e5m2: (2, 2.0**-14),
}


@triton.jit
def _round_to_fp8(x, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, MAX: tl.constexpr):
    # x (float32) saturated to +-MAX and rounded to nearest even on the grid of an
    # fp8 format with MANT mantissa bits, still as float32: the cast that follows
    # is then exact. Rounding here instead of in the cast because Triton's CPU
    # interpreter drops the carry when rounding up into the next exponent
    # (1.94 -> 1.0 in e4m3, measured with triton 3.9); on a GPU the native cast
    # would round the same way, so the stored bits are the same on both.
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) << 31
    a = tl.minimum(tl.abs(x), MAX)
    abits = a.to(tl.int32, bitcast=True)
    DROP: tl.constexpr = 23 - MANT
    lsb = (abits >> DROP) & 1
    normal = (abits + ((1 << (DROP - 1)) - 1) + lsb) & (-(1 << DROP))
    # Subnormals have a fixed step MIN_NORMAL / 2**MANT: adding a magic number whose
    # float32 ulp is that step rounds to it (nearest even), subtracting gives it back.
    MAGIC: tl.constexpr = MIN_NORMAL * 1.5 * (1 << (23 - MANT))
    sub = ((a + MAGIC) - MAGIC).to(tl.int32, bitcast=True)
    r = tl.where(a < MIN_NORMAL, sub, normal)
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [N, B, Hkv, D]
    value_cache_ptr,  # [N, B, Hkv, D]
    slot_ptr,  # [T'] int64
    num_slots,  # N * B: slots outside [0, num_slots) are skipped (memory safety)
    k_scale,  # fp8 caches only: stored = x / k_scale
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcn,
    stride_kcb,
    stride_kch,
    stride_vcn,
    stride_vcb,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8_MANT: tl.constexpr,  # 0: float cache (plain cast); 3 e4m3fn, 2 e5m2
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # One program per token: all heads of that token move as one [H_PAD, D_PAD] tile.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if (slot >= 0) & (slot < num_slots):
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        if FP8_MANT > 0:
            k = _round_to_fp8(k.to(tl.float32) / k_scale, FP8_MANT, FP8_MIN_NORMAL, FP8_MAX)
            v = _round_to_fp8(v.to(tl.float32) / v_scale, FP8_MANT, FP8_MIN_NORMAL, FP8_MAX)
        k_dst = key_cache_ptr + block * stride_kcn + offset * stride_kcb + h * stride_kch + d
        v_dst = value_cache_ptr + block * stride_vcn + offset * stride_vcb + h * stride_vch + d
        tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [N, B, Hkv, D]
    value_cache: torch.Tensor,  # [N, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T'] int64, T' <= T, -1 = skip
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token ``t``'s K/V to ``cache[slot // B, slot % B]``; slots ``-1`` are skipped.

    Slots outside the cache are skipped too (no read of the slot values on the host;
    the reference raises for them instead). An fp8 cache stores ``x / scale``
    saturated and rounded to nearest even, bit for bit what the reference stores.
    """
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    check_triton_device(key=key, key_cache=key_cache)
    check_last_dim_contiguous(key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    fp8 = _FP8_GRID.get(key_cache.dtype)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(), num_blocks * block_size,
        float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
        H_PAD=next_power_of_2(num_kv_heads), D_PAD=next_power_of_2(head_size),
        FP8_MANT=fp8[0] if fp8 else 0,
        FP8_MIN_NORMAL=fp8[1] if fp8 else 0.0,
        FP8_MAX=fp8_max(key_cache.dtype) if fp8 else 0.0,
    )  # fmt: skip


@triton.jit
def _copy_blocks_kernel(
    src_ptr,  # [N, *block]
    dst_ptr,  # [N2, *block]
    src_ids_ptr,  # [K]
    dst_ids_ptr,  # [K]
    num_src_blocks,
    num_dst_blocks,
    block_numel,
    stride_src,
    stride_dst,
    CHUNK: tl.constexpr,
):
    # Grid (K, chunks of one block): each program copies CHUNK contiguous elements.
    i = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    s = tl.load(src_ids_ptr + i).to(tl.int64)
    d = tl.load(dst_ids_ptr + i).to(tl.int64)
    if (s >= 0) & (s < num_src_blocks) & (d >= 0) & (d < num_dst_blocks):
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = offs < block_numel
        x = tl.load(src_ptr + s * stride_src + offs, mask=mask)
        tl.store(dst_ptr + d * stride_dst + offs, x, mask=mask)


def copy_blocks(
    src: torch.Tensor,  # [N, *block_shape]
    dst: torch.Tensor,  # [N2, *block_shape]
    src_block_ids: torch.Tensor,  # [K] int
    dst_block_ids: torch.Tensor,  # [K] int
) -> None:
    """``dst[dst_block_ids[i]] = src[src_block_ids[i]]``.

    Same-device copies run the Triton kernel; copies between devices (GPU <-> CPU
    offloading) are DMA transfers, done by torch (``reference.copy_blocks``). Ids
    given on the CPU are range-checked (ValueError); ids already on the GPU are not
    read back, and out-of-range pairs are skipped by the kernel.
    """
    check_copy_blocks(src, dst, src_block_ids, dst_block_ids)
    if src.device != dst.device:
        reference.copy_blocks(src, dst, src_block_ids, dst_block_ids)
        return
    check_triton_device(src=src, dst=dst)
    check_block_contiguous("src", src)
    check_block_contiguous("dst", dst)
    num = src_block_ids.shape[0]
    if num == 0:
        return
    for name, ids, limit in (
        ("src_block_ids", src_block_ids, src.shape[0]),
        ("dst_block_ids", dst_block_ids, dst.shape[0]),
    ):
        if ids.device.type == "cpu" and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            raise ValueError(f"{name} must be in [0, {limit}), got {ids.tolist()}")
    src_ids = src_block_ids.to(device=src.device).contiguous()
    dst_ids = dst_block_ids.to(device=dst.device).contiguous()
    block_numel = src[0].numel() if src.shape[0] else dst[0].numel()
    chunk = min(4096, next_power_of_2(block_numel))
    grid = (num, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        src, dst, src_ids, dst_ids, src.shape[0], dst.shape[0], block_numel,
        src.stride(0), dst.stride(0), CHUNK=chunk,
    )  # fmt: skip
