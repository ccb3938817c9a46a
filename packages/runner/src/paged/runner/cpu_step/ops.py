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
from dataclasses import dataclass

import torch

from paged.runner.cpu_step.build import load_step_ops

BF16 = torch.bfloat16
_ERRORS = {
    -1: "out of memory",
    -2: "slot_mapping holds a slot outside the KV cache",
    -3: "block_table holds a block id outside the KV cache (or too few columns for seq_lens)",
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


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One decode step's layout for `decode_attention_step`, checked once for every layer."""

    slot_mapping: torch.Tensor  # [R] int64, contiguous (-1 skips the write)
    block_table: torch.Tensor  # [R, M] int32, rows contiguous
    seq_lens: torch.Tensor  # [R] int32, contiguous, each >= 1
    # (num_reqs, slot ptr, table ptr, table row stride, table width, seq_lens ptr)
    raw: tuple[int, int, int, int, int, int]


def decode_step(
    slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> DecodeStep:
    """Check the step's tensors (dtypes, shapes, contiguity) and keep their addresses."""
    r = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (r,):
        raise ValueError(f"slot_mapping: expected int64 [{r}], got {slot_mapping.dtype}")
    if seq_lens.dtype != torch.int32 or r < 1:
        raise ValueError(f"seq_lens: expected int32 [R >= 1], got {seq_lens.dtype}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != r:
        raise ValueError(f"block_table: expected int32 [{r}, M], got {block_table.dtype}")
    if block_table.stride(1) != 1 or not slot_mapping.is_contiguous():
        raise ValueError("block_table rows and slot_mapping must be contiguous")
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    if bool((seq_lens < 1).any()):
        raise ValueError("seq_lens: every request needs at least its new token")
    raw = (
        r, slot_mapping.data_ptr(), block_table.data_ptr(), block_table.stride(0),
        block_table.shape[1], seq_lens.data_ptr(),
    )  # fmt: skip
    return DecodeStep(slot_mapping, block_table, seq_lens, raw)


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, sliding_window: int | None, soft_cap: float | None,
) -> torch.Tensor:  # fmt: skip
    """Write one new token per request into the cache, then attend; [R, Hq*D] bf16.

    query [R, Hq*D], key/value [R, Hkv*D] bf16 rows; caches [N, B, Hkv, D]
    bf16, contiguous; slot_mapping [R] int64 (-1 skips the write);
    block_table [R, M] int32 (row-contiguous); seq_lens [R] int32, each >= 1.
    Same maths as reshape_and_cache + paged_attention with max_query_len 1.
    """
    step = decode_step(slot_mapping, block_table, seq_lens)
    return decode_attention_step(
        step, query, key, value, key_cache, value_cache, scale, sliding_window, soft_cap
    )


def decode_attention_step(
    step: DecodeStep, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor,
    scale: float, sliding_window: int | None, soft_cap: float | None,
) -> torch.Tensor:  # fmt: skip
    """decode_attention with the step's layout checked already (one layer's call)."""
    r = step.raw[0]
    num_blocks, block_size, hkv, d = key_cache.shape
    if not (
        query.dtype is BF16 and key.dtype is BF16 and value.dtype is BF16
        and query.dim() == 2 and key.dim() == 2 and value.dim() == 2
        and query.stride(1) == 1 and key.stride(1) == 1 and value.stride(1) == 1
        and query.shape[0] == r and key.shape == (r, hkv * d) and value.shape == (r, hkv * d)
        and query.shape[1] % (hkv * d) == 0
    ):  # fmt: skip
        raise ValueError(
            f"query/key/value: expected bf16 rows [{r}, Hq*{d}] / [{r}, {hkv * d}] with "
            f"contiguous columns, got {query.dtype} {tuple(query.shape)}, "
            f"{key.dtype} {tuple(key.shape)}, {value.dtype} {tuple(value.shape)}"
        )
    if not (
        key_cache.dtype is BF16 and value_cache.dtype is BF16
        and value_cache.shape == key_cache.shape
        and key_cache.is_contiguous() and value_cache.is_contiguous()
    ):  # fmt: skip
        raise ValueError(f"key/value cache: expected contiguous bf16 {tuple(key_cache.shape)}")
    hq = query.shape[1] // d
    out = torch.empty(r, hq * d, dtype=BF16)
    _, slots, table, table_stride, table_width, seq = step.raw
    code = _lib().paged_decode_attention(
        query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0),
        value.data_ptr(), value.stride(0),
        slots, key_cache.data_ptr(), value_cache.data_ptr(), num_blocks * block_size,
        table, table_stride, table_width, block_size,
        seq, r, hq, hkv, d, scale, sliding_window or 0, soft_cap or 0.0,
        out.data_ptr(),
    )  # fmt: skip
    _check(code, "decode_attention")
    return out


def _vector(name: str, w: torch.Tensor, n: int) -> None:
    if w.dtype != torch.float32 or w.shape != (n,) or not w.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous float32 [{n}] tensor, got {w.dtype}")
