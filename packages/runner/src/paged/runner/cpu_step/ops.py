"""Typed wrappers over step_ops.c: each checks what the C code relies on, then makes one call.

Every function takes and returns bfloat16 activations (the quantised CPU path's
dtype) and computes in float32, like the paged.kernels.reference op it
replaces; the tests bound the difference (bit-identical for the rotary).
`available()` says whether the library loaded; callers keep their torch path
for the other cases (no compiler, $PAGED_CPU_STEP_OPS=off, float32 models).

The checks matter: the C code trusts shapes and strides, so a wrong one would
read or write outside a tensor instead of raising. They are attribute reads
(well under a microsecond each), cheaper than the torch ops they replace.
"""

from __future__ import annotations

import ctypes

import torch

from paged.runner.cpu_step.build import load_step_ops

BF16 = torch.bfloat16
_ERRORS = {
    -1: "out of memory",
}


_calibrated: list[ctypes.CDLL] = []
_widths: dict[int, int] = {}


def available() -> bool:
    """True when the compiled library is loaded (compiling it on the first call)."""
    return load_step_ops() is not None


def step_library() -> ctypes.CDLL | None:
    """The loaded library, its norm's summation width calibrated; None when unavailable.

    For C code that calls these functions itself (cpu_step/fused.py).
    """
    return _lib() if available() else None


def _lib() -> ctypes.CDLL:
    lib = load_step_ops()
    if lib is None:
        raise RuntimeError("the CPU step ops are unavailable (see the warning logged at load)")
    if lib not in _calibrated:
        _widths[id(lib)] = _calibrate_sum_width(lib)
        _calibrated.append(lib)
    return lib


def _calibrate_sum_width(lib: ctypes.CDLL) -> int:
    """Give the C norm the vector width of torch's float sum on this machine (8 or 16).

    The norm replays torch's summation order so that its results are F.rms_norm's
    bit for bit; the order depends on the width torch's kernels were built
    with, so it is measured: the width whose sums of squares equal
    `(x * x).sum(-1)` on rows of several lengths. None matching (another
    torch summation): 8, and the norm is then within rounding, not exact.
    """
    gen = torch.Generator().manual_seed(1234)
    for width in (8, 16):
        lib.paged_set_sum_width(width)
        if all(_sums_match(lib, h, gen) for h in (576, 1000, 2048, 4096)):
            return width
    lib.paged_set_sum_width(8)
    return 8


def _sums_match(lib: ctypes.CDLL, h: int, gen: torch.Generator) -> bool:
    x = torch.randn(16, h, generator=gen) * 30
    ours = torch.empty(16)
    lib.paged_sum_squares(x.data_ptr(), 16, h, ours.data_ptr())
    return torch.equal(ours, (x * x).sum(-1))


def sum_width() -> int:
    """The summation width the norm replays (8 or 16), calibrated on first use."""
    lib = _lib()
    return _widths[id(lib)]


def _rows(name: str, x: torch.Tensor, dtype: torch.dtype, cols: int | None = None) -> None:
    """x must be a 2-D CPU tensor of `dtype` with unit column stride (rows may be strided)."""
    if (
        x.dtype is dtype
        and x.dim() == 2
        and x.stride(1) == 1
        and x.is_cpu
        and (cols is None or x.shape[1] == cols)
    ):
        return  # the common case: one expression, no formatting
    if x.dtype != dtype or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(
            f"{name}: expected a 2-D CPU {dtype} tensor, got {x.dtype} {tuple(x.shape)}"
        )
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"{name}: columns must be contiguous, got strides {x.stride()}")
    if cols is not None and x.shape[1] != cols:
        raise ValueError(f"{name}: expected {cols} columns, got {x.shape[1]}")


def _check(code: int, what: str) -> None:
    if code != 0:
        raise ValueError(f"{what}: {_ERRORS.get(code, f'error {code}')}")


def rms_norm(x: torch.Tensor, weight_f32: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16(rms_norm(x) * w) for x [T, H] float32 or bfloat16; weight_f32 [H] float32."""
    if x.dtype not in (torch.float32, BF16):
        raise ValueError(f"x: expected float32 or bfloat16, got {x.dtype}")
    _rows("x", x, x.dtype)
    h = x.shape[1]
    _vector("weight", weight_f32, h)
    out = torch.empty(x.shape, dtype=BF16)
    _lib().paged_rms_norm(
        x.data_ptr(), int(x.dtype == BF16), x.stride(0), weight_f32.data_ptr(), eps,
        out.data_ptr(), x.shape[0], h,
    )  # fmt: skip
    return out


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight_f32: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (float32, in place); returns bf16(rms_norm(residual) * w).

    x [T, H] bfloat16, residual [T, H] contiguous float32 that the caller owns
    (the model's residual stream), weight_f32 [H].
    """
    _rows("x", x, BF16)
    t, h = x.shape
    if residual.dtype != torch.float32 or residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError(
            f"residual: expected a contiguous float32 {tuple(x.shape)} tensor, "
            f"got {residual.dtype} {tuple(residual.shape)}"
        )
    _vector("weight", weight_f32, h)
    out = torch.empty(x.shape, dtype=BF16)
    _lib().paged_add_rms_norm(
        x.data_ptr(), x.stride(0), residual.data_ptr(), weight_f32.data_ptr(), eps,
        out.data_ptr(), t, h,
    )  # fmt: skip
    return out


SILU, GELU_TANH = 0, 1


def gated_act(x: torch.Tensor, kind: int) -> torch.Tensor:
    """[T, 2I] bf16 -> [T, I] bf16: act(x[:, :I]) * x[:, I:]; kind SILU or GELU_TANH."""
    _rows("x", x, BF16)
    if x.shape[1] % 2 or kind not in (SILU, GELU_TANH):
        raise ValueError(f"x: expected an even number of columns and a known kind, got {x.shape}")
    half = x.shape[1] // 2
    out = torch.empty(x.shape[0], half, dtype=BF16)
    _lib().paged_gated_act(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], half, kind)
    return out


def rotary_neox(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
    head_size: int, cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """NeoX rotary over all of every head: new contiguous (query, key), bf16.

    positions [T] int64; query [T, Hq*D], key [T, Hkv*D] bf16 (row strides
    free: views of the qkv output); cos_sin_cache [max_pos, D] float32 (cos | sin).
    """
    _rows("query", query, BF16)
    t = query.shape[0]
    _rows("key", key, BF16)
    if positions.dtype != torch.int64 or positions.dim() != 1 or not positions.is_contiguous():
        raise ValueError(f"positions: expected contiguous int64 [T], got {positions.dtype}")
    n = positions.shape[0]
    if t != n or key.shape[0] != n or query.shape[1] % head_size or key.shape[1] % head_size:
        raise ValueError(
            f"query/key must be [T={n}, H * {head_size}], got "
            f"{tuple(query.shape)} and {tuple(key.shape)}"
        )
    _rows("cos_sin_cache", cos_sin_cache, torch.float32, head_size)
    if not cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache must be contiguous")
    q_out = torch.empty(query.shape, dtype=BF16)
    k_out = torch.empty(key.shape, dtype=BF16)
    code = _lib().paged_rotary_neox(
        query.data_ptr(), query.stride(0), query.shape[1] // head_size,
        key.data_ptr(), key.stride(0), key.shape[1] // head_size,
        positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], head_size,
        q_out.data_ptr(), k_out.data_ptr(), t,
    )  # fmt: skip
    if code != 0:
        raise ValueError(f"positions must be in [0, {cos_sin_cache.shape[0]})")
    return q_out, k_out


def _vector(name: str, w: torch.Tensor, n: int) -> None:
    if w.dtype != torch.float32 or w.shape != (n,) or not w.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous float32 [{n}] tensor, got {w.dtype}")
