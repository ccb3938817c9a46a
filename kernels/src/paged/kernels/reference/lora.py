"""LoRA shrink/expand in torch: one matmul per adapter slot (the CPU path, and the definition).

Shapes: T tokens, S adapter slots, R max rank (smaller ranks zero-padded by the
caller), ``in``/``N`` the base layer's in/out features, M the width of ``out``
(a fused qkv or gate_up output holds several slices side by side).

Every product accumulates in float32 (bf16/fp16 operands are upcast, which is
also what lets a float32 activation meet bf16 adapter weights) and is rounded
once to the destination dtype. Rows are grouped by slot once (``groups``), never
a ``[T, R, in]`` gather of per-row weights:

- small groups (decode rows of several adapters) share ONE ``bmm`` over the
  padded ``[slots, rows_per_slot]`` layout against the weight stack's slot range
  (a view): a fixed handful of torch calls whatever the number of adapters;
- the other groups (a prefill chunk) get one ``[rows, in] x [in, R]`` matmul
  each, on views when their rows are consecutive.
"""

from __future__ import annotations

import torch

from paged.kernels.lora import (
    LoRARowGroups,
    PaddedLoRARows,
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
    if groups.padded is not None:
        p = groups.padded
        stack = _f32(lora_a[p.slot_lo : p.slot_lo + p.num_slots])  # [n, R, in], a view
        y[p.rows] = _padded_bmm(x, p, stack).to(x.dtype)
    for i in groups.loop:
        slot, rows = groups.slots[i], groups.rows[i]
        y[rows] = torch.mm(_f32(x[rows]), _f32(lora_a[slot]).t()).to(x.dtype)
    return y


def _padded_bmm(
    x: torch.Tensor, p: PaddedLoRARows, stack: torch.Tensor, *, rows_taken: bool = False
) -> torch.Tensor:
    """``stack[slot(r)] @ x[r]`` for each row r of ``p.rows``: [P, stack rows], float32.

    ``rows_taken``: ``x`` already holds just those rows, in ``p.rows`` order.
    """
    n, m = p.num_slots, p.rows_per_slot
    rows = _f32(x if rows_taken else x[p.rows])
    if p.dense:
        flat = rows
    else:
        flat = torch.zeros(n * m, x.shape[1], dtype=torch.float32, device=x.device)
        flat[p.index] = rows
    result = torch.bmm(flat.view(n, m, x.shape[1]), stack.transpose(1, 2)).view(n * m, -1)
    return result if p.dense else result[p.index]


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
    if groups.padded is not None:
        p = groups.padded
        stack = _f32(lora_b[p.slot_lo : p.slot_lo + p.num_slots])  # [n, N, R], a view
        scaled = _f32(y[p.rows]) * scaling[p.entry_slots].unsqueeze(1)
        _add_rows(out, p.rows, cols, _padded_bmm(scaled, p, stack, rows_taken=True))
    for i in groups.loop:
        slot, rows = groups.slots[i], groups.rows[i]
        # The scale multiplies y's R columns rather than the N outputs (cheaper; equal
        # to PEFT's B(A x) * s up to float32 rounding). scaling[slot] stays a tensor:
        # no host sync on CUDA.
        delta = torch.mm(_f32(y[rows]) * scaling[slot], _f32(lora_b[slot]).t())
        _add_rows(out, rows, cols, delta)


def _add_rows(
    out: torch.Tensor, rows: slice | torch.Tensor, cols: slice, delta: torch.Tensor
) -> None:
    """``out[rows, cols] += delta`` (float32 delta), rounded once to ``out``'s dtype."""
    if isinstance(rows, slice):
        out[rows, cols].add_(delta)  # a view; add_ computes in float32, rounds once
    elif out.dtype == torch.float32:
        out[:, cols].index_add_(0, rows, delta)  # in place through the column view
    else:
        out[rows, cols] = (out[rows, cols].float() + delta).to(out.dtype)
