"""LoRA shrink/expand in torch: one matmul per adapter slot (the CPU path, and the definition).

Shapes: T tokens, S adapter slots, R max rank (smaller ranks zero-padded by the
caller), ``in``/``N`` the base layer's in/out features, M the width of ``out``
(a fused qkv or gate_up output holds several slices side by side).

Every product accumulates in float32 (bf16/fp16 operands are upcast, which is
also what lets a float32 activation meet bf16 adapter weights) and is rounded
once to the destination dtype. Rows are grouped by slot once (``groups``), so the
cost is one ``[rows, in] x [in, R]`` matmul per distinct adapter in the step,
never a ``[T, R, in]`` gather of per-row weights.
"""

from __future__ import annotations

import torch

from paged.kernels.lora import (
    LoRARowGroups,
    check_lora_expand,
    check_lora_groups,
    check_lora_shrink,
    group_lora_rows,
)

__all__ = ["lora_expand", "lora_shrink"]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, R, in]
    token_slots: torch.Tensor,  # [T] int32/int64, -1 = no adapter
    *,
    groups: LoRARowGroups | None = None,
) -> torch.Tensor:  # [T, R], dtype of x
    """``y[t] = lora_a[slot[t]] @ x[t]``; rows with slot -1 are zero."""
    check_lora_shrink(x, lora_a, token_slots, groups)
    if groups is None:
        groups = group_lora_rows(token_slots)
        check_lora_groups(groups, token_slots, lora_a.shape[0], x.device)
    y = torch.zeros(x.shape[0], lora_a.shape[1], dtype=x.dtype, device=x.device)
    for slot, rows in zip(groups.slots, groups.rows, strict=True):
        y[rows] = torch.mm(_f32(x[rows]), _f32(lora_a[slot]).t()).to(x.dtype)
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
    if groups is None:
        groups = group_lora_rows(token_slots)
        check_lora_groups(groups, token_slots, lora_b.shape[0], y.device)
    cols = slice(out_offset, out_offset + lora_b.shape[1])
    for slot, rows in zip(groups.slots, groups.rows, strict=True):
        # scaling[slot] stays a tensor: no host sync on CUDA. PEFT's order: B(A x) * s.
        delta = torch.mm(_f32(y[rows]), _f32(lora_b[slot]).t()) * scaling[slot]
        if isinstance(rows, slice):
            # A view, updated in place; add_ computes in float32 and rounds once.
            out[rows, cols].add_(delta)
        else:
            out[rows, cols] = (_f32(out[rows, cols]) + delta).to(out.dtype)
