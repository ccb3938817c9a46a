"""Triton RMSNorm (optionally fused with the residual add) and gated activations.

Every kernel loads in the storage dtype, computes in float32 and rounds once on
store, exactly like the reference.
"""

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
from paged.kernels.validation import check_gated, check_rms_norm

__all__ = ["fused_add_rms_norm", "gelu_tanh_and_mul", "rms_norm", "silu_and_mul"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H] (read only when HAS_RESIDUAL)
    weight_ptr,  # [H]
    out_ptr,  # [T, H] contiguous
    residual_out_ptr,  # [T, H] contiguous (written only when HAS_RESIDUAL)
    stride_x,
    stride_r,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per row; the whole row is one tile (hidden sizes are <= 16k).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w += 1.0
    tl.store(out_ptr + row * hidden + cols, x * inv_rms * w, mask=mask)


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    gemma_style: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_rms_norm(x, weight, eps, residual)
    check_triton_device(x=x, weight=weight)
    check_last_dim_contiguous(x=x, weight=weight)
    if residual is not None:
        check_last_dim_contiguous(residual=residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else None
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, residual if residual is not None else x, weight, out,
            residual_out if residual_out is not None else out,
            x.stride(0), residual.stride(0) if residual is not None else 0, x.shape[1], eps,
            HAS_RESIDUAL=residual is not None, GEMMA=gemma_style,
            BLOCK_H=next_power_of_2(x.shape[1]),
        )  # fmt: skip
    return out, residual_out


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    *,
    gemma_style: bool = False,
) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * w`` with ``w = weight`` (or ``1 + weight`` for Gemma)."""
    out, _ = _launch_rms_norm(x, None, weight, eps, gemma_style)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    *,
    gemma_style: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; the sum is formed in float32."""
    out, residual_out = _launch_rms_norm(x, residual, weight, eps, gemma_style)
    assert residual_out is not None  # launched with a residual
    return out, residual_out


@triton.jit
def _tanh(x):
    # tanh from exp: tl has no portable tanh in both the interpreter and CUDA.
    # Clamped where tanh is +-1 in float32 anyway, so exp cannot overflow.
    z = tl.minimum(tl.maximum(2.0 * x, -40.0), 40.0)
    return 1.0 - 2.0 / (tl.exp(z) + 1.0)


@triton.jit
def _gated_kernel(
    x_ptr,  # [T, 2I]
    out_ptr,  # [T, I] contiguous
    stride_x,
    inter,
    ACT: tl.constexpr,  # 0 = silu, 1 = gelu(tanh)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi)
        act = 0.5 * gate * (1.0 + _tanh(inner))
    tl.store(out_ptr + row * inter + cols, act * up, mask=mask)


def _launch_gated(x: torch.Tensor, act: int) -> torch.Tensor:
    check_gated(x)
    check_triton_device(x=x)
    check_last_dim_contiguous(x=x)
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    if x.shape[0] and inter:
        block = min(1024, next_power_of_2(inter))
        grid = (x.shape[0], triton.cdiv(inter, block))
        _gated_kernel[grid](x, out, x.stride(0), inter, ACT=act, BLOCK=block)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(x[:, :I]) * x[:, I:]``."""
    return _launch_gated(x, 0)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``gelu_tanh(x[:, :I]) * x[:, I:]``."""
    return _launch_gated(x, 1)
