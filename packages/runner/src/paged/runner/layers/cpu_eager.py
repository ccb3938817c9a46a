"""CPU eager fast paths for the per-layer elementwise ops: the reference maths, fewer ops.

On CPU every op of a decode step costs a few microseconds of dispatch
whatever its size, and a SmolLM2 step runs ~30 layers x ~80 ops, so at batch 1
the glue costs more than the quantised matmuls (`benchmarks/profile_step.py`).
`paged.kernels.ops` routes through a backend choice and validates its inputs
on every call (a fixed cost per op); the functions here compute exactly what
`paged.kernels.reference` computes (same float32 ops in the same order, so
bit-identical results), minus the validation, minus a float32 copy of the
norm weight per call (the caller caches it), and with one add fewer per
fused residual norm. They are used only where `cpu_fast_path(x)` holds:
a CPU tensor while the kernel backend resolves to the reference one.

The residual stream on CPU is float32 whatever the model dtype (one dtype
for the whole stream, so no cast back and forth per layer; it is also what
llama.cpp keeps): `start_residual` makes the stream's own float32 copy at the
first layer, `add_rms_norm_` adds each sub-layer's output into it in place
and normalises it to the model dtype. With bfloat16 activations and the C
library loaded (`paged.runner.cpu_step`) the norms and gated activations
are one C call each instead of three to six torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged.kernels import ops, reference
from paged.runner.cpu_step import ops as native


def cpu_fast_path(x: torch.Tensor) -> bool:
    """True when ops on `x` would run paged.kernels.reference on CPU."""
    return x.device.type == "cpu" and ops.backend_for(x) is reference


def rms_norm(
    x: torch.Tensor, weight_f32: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """reference.rms_norm with the float32 weight given (x [T, H]), in out_dtype (x's)."""
    dtype = x.dtype if out_dtype is None else out_dtype
    if dtype is torch.bfloat16 and x.dim() == 2 and native.available():
        return native.rms_norm(x, weight_f32, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight_f32, eps).to(dtype)


def residual_stream(x: torch.Tensor) -> torch.Tensor:
    """x in the residual stream's dtype: float32 on the CPU fast path, else unchanged."""
    return x.float() if cpu_fast_path(x) else x


def start_residual(
    x: torch.Tensor, weight_f32: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x) in x's dtype, a float32 copy of x owned by the residual stream)."""
    residual = x.to(torch.float32, copy=True)
    return rms_norm(residual, weight_f32, eps, x.dtype), residual


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight_f32: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x in place (the stream's float32 tensor); returns its norm in x's dtype.

    The same numbers as fused_add_rms_norm (x + r == r + x in float32).
    """
    if residual.shape != x.shape:
        raise ValueError(f"residual must match x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if (
        x.dtype is torch.bfloat16
        and residual.dtype is torch.float32
        and x.dim() == 2
        and native.available()
    ):
        return native.add_rms_norm_(x, residual, weight_f32, eps)
    residual.add_(x)
    return F.rms_norm(residual.float(), (x.shape[-1],), weight_f32, eps).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight_f32: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.fused_add_rms_norm: (rms_norm(x + residual), x + residual), sum in float32.

    x.to(float32, copy=True) is a fresh tensor (never x itself, even in
    float32), so the in-place add leaves both inputs untouched.
    """
    if residual.shape != x.shape:
        raise ValueError(f"residual must match x {tuple(x.shape)}, got {tuple(residual.shape)}")
    total = x.to(torch.float32, copy=True).add_(residual)
    normed = F.rms_norm(total, (x.shape[-1],), weight_f32, eps).to(x.dtype)
    return normed, total.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """reference.silu_and_mul: silu(x[:, :I]) * x[:, I:] in float32."""
    if x.dtype is torch.bfloat16 and native.available():
        return native.gated_act(x, native.SILU)
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """reference.gelu_tanh_and_mul: gelu_tanh(x[:, :I]) * x[:, I:] in float32."""
    if x.dtype is torch.bfloat16 and native.available():
        return native.gated_act(x, native.GELU_TANH)
    gate, up = x.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)
