"""The LoRA delta of one linear layer, for every row of the step at once (Punica's shrink/expand).

A `LoRALinear` is attached to a base `ShardedLinear` (its `lora` attribute,
composition: the base layer and its quantised kernel are untouched). After the
base matmul the layer calls `add_to(x, y)`:

    t = lora_shrink(x, A_all, token_slots)                  [T, n*R]
    y  += scaling[slot] * B_all[slot] @ t                  (lora_expand at offset 0)

Device slot stacks, one pair per layer, dtype lora_dtype, zero-padded past each
adapter's rank; a fused layer's n slices (q, k, v of qkv; gate, up of gate_up)
are stacked so that one shrink and one expand serve them all:

    A_all [S, n*R, in_local]        slice i: rows [i*R, (i+1)*R)
    B_all [S, out_local, n*R]       slice i: its output rows x columns [i*R, (i+1)*R);
                                    zero elsewhere (block diagonal)

Two op calls a layer instead of 2n: a decode step of a 30-layer model makes
120 LoRA calls instead of 420, and the zero blocks cost less than the calls
(measured in benchmarks/lora_engine_bench.py). `LoRASlice` holds views of one
slice's blocks; the manager writes adapters through them.

On the CPU (bfloat16 or float32 stacks, the C kernel built) B_all is stored
transposed, `Bt_all [S, n*R, out_local]` with B_all its view, and the whole
delta is ONE C call (cpu_kernels/lora_delta.c through `native`, a
`LoRADeltaPlan`): rows of one slot together, only each slice's own block of B,
only each slot's adapter rank. The fused CPU decoder layers call the same C
function with the same plan (cpu_step/fused.py), so both paths give the same bits.
The torch/Triton ops serve every other case (CUDA, float16 stacks, no compiler).

Tensor parallelism shards an adapter like its base layer:
    column-parallel (qkv, gate_up): B split on output rows as the base weight's
        rows (the same q/k/v head ranges), A whole;
    row-parallel (o_proj, down_proj): A split on input columns, B whole; the
        delta is added to the partial sum BEFORE the all-reduce, so
        sum_r B (A_r x_r) = B (A x) exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged.kernels import ops, reference
from paged.kernels.lora import LoRARowGroups
from paged.runner.cpu_kernels.lora_delta import LoRADeltaPlan

__all__ = ["LoRABatch", "LoRALinear", "LoRASlice"]


@dataclass
class LoRABatch:
    """This step's rows, shared by every LoRA layer of a model (owned by the `LoRAManager`).

    `token_slots` [T] int64 on the device: the device slot of each token's
    adapter, -1 for base-model rows; None for a step without any LoRA row (the
    layers then do nothing, and the fused CPU path and CUDA graphs stay usable).
    `scaling` [S] float32: each slot's adapter scaling; `ranks` [S] int64: each
    slot's adapter rank (0: empty; the C kernel skips the zero padding past it).
    `groups`: the rows grouped by slot once per step (built from the host copy: no
    device sync), shared by every shrink/expand call of the step.
    """

    scaling: torch.Tensor
    ranks: torch.Tensor
    token_slots: torch.Tensor | None = None
    groups: LoRARowGroups | None = None

    @property
    def active(self) -> bool:
        return self.token_slots is not None


@dataclass
class LoRASlice:
    """One target module inside a (possibly fused, possibly sharded) base layer.

    `module` is the Hugging Face module path (e.g. model.layers.0.self_attn.k_proj).
    The full adapter tensors must be A [r, full_in], B [full_out, r]; this rank
    holds A columns [in_start, in_start + a.shape[2]) and B rows
    [out_start, out_start + b.shape[1]), written at `out_offset` of the layer's
    local output.
    """

    module: str
    full_in: int
    full_out: int
    in_start: int
    out_start: int
    out_offset: int
    a: torch.Tensor  # [S, R, in_local], a view of the layer's A_all
    b: torch.Tensor  # [S, out_local_slice, R], a view of the layer's B_all

    def write(self, slot: int, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None) -> None:
        """Put this rank's share of one adapter's full (A, B) in `slot` (None: not targeted)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if lora_a is None or lora_b is None:
            return
        rank = lora_a.shape[0]
        in_local, out_local = self.a.shape[2], self.b.shape[1]
        self.a[slot, :rank].copy_(lora_a[:, self.in_start : self.in_start + in_local])
        self.b[slot, :, :rank].copy_(lora_b[self.out_start : self.out_start + out_local])


class LoRALinear:
    """The per-row LoRA delta of one base linear layer (see the module docstring)."""

    def __init__(
        self,
        batch: LoRABatch,
        slices: list[LoRASlice],
        a_all: torch.Tensor,
        b_all: torch.Tensor,
        native: LoRADeltaPlan | None = None,
    ) -> None:
        self.batch = batch
        self.slices = slices
        self.a_all = a_all  # [S, n*R, in_local]
        self.b_all = b_all  # [S, out_local, n*R] (a transposed view with `native`)
        # The C kernel's plan over the same stacks (CPU only; see the module docstring).
        self.native = native

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out_local] += this step's deltas for x [T, in_local]; nothing without LoRA rows."""
        slots, groups = self.batch.token_slots, self.batch.groups
        if slots is None:
            return
        native = self.native
        if native is not None and ops.backend_for(x) is reference and y.stride(-1) == 1:
            native.add_to(x if x.stride(-1) == 1 else x.contiguous(), y, slots)
            return
        b_all = self.b_all
        if b_all.stride(-1) != 1 and ops.backend_for(x) is not reference:
            b_all = b_all.contiguous()  # Triton wants contiguous rows (CPU tests, interpreter)
        dtype = self.a_all.dtype
        # The delta runs in lora_dtype (A @ x rounded to it); expand accumulates in
        # float32 and rounds once into y, whatever y's dtype (bf16 on the quantised path).
        xd = x if x.dtype == dtype else x.to(dtype)
        shrunk = ops.lora_shrink(xd, self.a_all, slots, groups=groups)
        ops.lora_expand(shrunk, b_all, slots, y, 0, self.batch.scaling, groups=groups)
