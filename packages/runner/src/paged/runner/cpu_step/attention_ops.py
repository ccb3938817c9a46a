"""Typed wrapper over attention.c: paged attention for steps of short query runs, one C call.

`attention.c` is its own shared library (compiled and cached by
`paged.runner.c_compile`, like step_ops.c; `$PAGED_CPU_STEP_OPS=off` turns it
off too). `rows_step()` checks a step's layout once (slot mapping, block
table, query starts, sequence lengths); `attention_rows_step()` then checks
one layer's tensors and makes the call. The C code trusts shapes and strides,
so these checks are what keep a wrong tensor from reading outside memory.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from paged.runner.c_compile import compiled_library, first_line, open_checked, package_source
from paged.runner.cpu_step import build

logger = logging.getLogger(__name__)

BF16 = torch.bfloat16
_ABI = 3  # paged_attention_abi() of the source this module drives
# No -ffp-contract=off here: fused multiply-adds change nothing this code promises
# (it is within rounding of the reference, and equal to itself across layouts).
_FLAGS = [
    "-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno",
    "-shared", "-fPIC", "-std=c11",
    "-Werror=implicit-function-declaration", "-Wl,--no-undefined",
]  # fmt: skip
_ERRORS = {
    -1: "out of memory",
    -2: "slot_mapping holds a slot outside the KV cache",
    -3: "block_table holds a block id outside the KV cache (or too few columns for seq_lens)",
    -4: "query_start_loc and seq_lens disagree (a request with more query rows than tokens?)",
    -5: "head size must be in [1, 256]",
}

_loaded: dict[str, ctypes.CDLL | None] = {}


def load_attention_ops(compiler: str | None = None) -> ctypes.CDLL | None:
    """The loaded library (compiled if needed), or None if disabled or unavailable.

    Disabled with the step ops ($PAGED_CPU_STEP_OPS=off, read once; see
    `build.load_step_ops`). Failures log one warning and return None.
    """
    if compiler is None:
        if build.load_step_ops() is None:  # off (or no compiler): the torch path
            return None
        compiler = os.environ.get("CC") or "cc"
    elif not build.enabled():
        return None
    if compiler not in _loaded:
        _loaded[compiler] = _build_and_load(compiler)
    return _loaded[compiler]


def available() -> bool:
    """True when the compiled attention library is loaded (compiling it on the first call)."""
    return load_attention_ops() is not None


def _build_and_load(cc: str, flags: list[str] | None = None) -> ctypes.CDLL | None:
    """Compile (cached) and load; `flags` replaces the defaults (tests: -mno-avx512f)."""
    try:
        path = _compiled(cc, _FLAGS if flags is None else flags)
        lib = open_checked(path, "paged_attention_abi", _ABI)
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        fn = lib.paged_attention_rows
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ptr, i64, ptr, i64, ptr, i64,  # q, k, v and their row strides
            ptr, i64, ptr, ptr, i64,  # slot_mapping, T, key_cache, value_cache, num_slots
            ptr, i64, i64, i64,  # block_table, its stride and width, block_size
            ptr, ptr, i64,  # query_start_loc, seq_lens, R
            i64, i64, i64, f32, i64, f32, ptr,  # hq, hkv, d, scale, window, cap, out
        ]  # fmt: skip
        lib.paged_attention_use_pool.restype = None
        lib.paged_attention_use_pool.argtypes = [ptr, ptr, ctypes.c_int]
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU attention unavailable (%s); using torch SDPA", first_line(exc))
        return None
    return lib


def _compiled(cc: str, flags: list[str]) -> Path:
    source = package_source("paged.runner.cpu_step", "attention.c")
    return compiled_library(cc, source, "attention.c", "attention", flags)


def use_pool(run: int | None, pool: int | None, threads: int) -> None:
    """Run the attention's tasks on a CpuPool (see paged.runner.cpu_kernels.pool); None, None:
    on the calling thread. Nothing when the library is unavailable."""
    lib = load_attention_ops()
    if lib is not None:
        lib.paged_attention_use_pool(run, pool, threads)


def _lib() -> ctypes.CDLL:
    lib = load_attention_ops()
    if lib is None:
        raise RuntimeError("the CPU attention is unavailable (see the warning logged at load)")
    return lib


@dataclass(frozen=True, slots=True)
class RowsStep:
    """One step's layout for `attention_rows_step`, checked once for every layer."""

    slot_mapping: torch.Tensor  # [T] int64, contiguous (-1 skips the write)
    block_table: torch.Tensor  # [R, M] int32, rows contiguous
    query_start_loc: torch.Tensor  # [R + 1] int32, contiguous
    seq_lens: torch.Tensor  # [R] int32, contiguous, each >= its query rows
    max_query_len: int
    # (T, R, slot ptr, table ptr, table row stride, table width, qsl ptr, seq_lens ptr)
    raw: tuple[int, int, int, int, int, int, int, int]
    # the library, looked up once a step rather than once a layer (an environment
    # lookup and two calls: ~13 us, 30 times a step on a 30-layer model)
    lib: ctypes.CDLL


def rows_step(
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> RowsStep:
    """Check a step's tensors (dtypes, shapes, contiguity, lengths) and keep their addresses."""
    r = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dtype != torch.int32 or r < 1 or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens: expected contiguous int32 [R >= 1], got {seq_lens.dtype}")
    if (
        query_start_loc.dtype != torch.int32
        or query_start_loc.shape != (r + 1,)
        or not query_start_loc.is_contiguous()
    ):
        raise ValueError(
            f"query_start_loc: expected contiguous int32 [{r + 1}], "
            f"got {query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if int(query_start_loc[0]) != 0 or bool((q_lens < 0).any()) or bool((q_lens > seq_lens).any()):
        raise ValueError(
            "query_start_loc: must start at 0, rise, and give each request <= seq_len rows"
        )
    t = int(query_start_loc[-1])
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (t,):
        raise ValueError(
            f"slot_mapping: expected int64 [{t}], "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != r:
        raise ValueError(f"block_table: expected int32 [{r}, M], got {block_table.dtype}")
    if block_table.stride(1) != 1 or not slot_mapping.is_contiguous():
        raise ValueError("block_table rows and slot_mapping must be contiguous")
    raw = (
        t, r, slot_mapping.data_ptr(), block_table.data_ptr(), block_table.stride(0),
        block_table.shape[1], query_start_loc.data_ptr(), seq_lens.data_ptr(),
    )  # fmt: skip
    max_q = int(q_lens.max())
    return RowsStep(slot_mapping, block_table, query_start_loc, seq_lens, max_q, raw, _lib())


def attention_rows_step(
    step: RowsStep, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor,
    scale: float, sliding_window: int | None, soft_cap: float | None,
) -> torch.Tensor:  # fmt: skip
    """Write the step's K/V rows into the cache, then attend every row; [T, Hq*D] bf16.

    query [T, Hq*D], key/value [T, Hkv*D] bf16 rows (contiguous columns, row
    strides free); caches [N, B, Hkv, D] bf16, contiguous. Same maths as
    reshape_and_cache + paged_attention (causal within each request's rows).
    """
    t = step.raw[0]
    num_blocks, block_size, hkv, d = key_cache.shape
    if not (
        query.dtype is BF16 and key.dtype is BF16 and value.dtype is BF16
        and query.dim() == 2 and key.dim() == 2 and value.dim() == 2
        and query.stride(1) == 1 and key.stride(1) == 1 and value.stride(1) == 1
        and query.shape[0] == t and key.shape == (t, hkv * d) and value.shape == (t, hkv * d)
        and query.shape[1] % (hkv * d) == 0 and query.is_cpu
    ):  # fmt: skip
        raise ValueError(
            f"query/key/value: expected bf16 CPU rows [{t}, Hq*{d}] / [{t}, {hkv * d}] with "
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
    out = torch.empty(t, hq * d, dtype=BF16)
    _, r, slots, table, table_stride, table_width, qsl, seq = step.raw
    code = step.lib.paged_attention_rows(
        query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0),
        value.data_ptr(), value.stride(0),
        slots, t, key_cache.data_ptr(), value_cache.data_ptr(), num_blocks * block_size,
        table, table_stride, table_width, block_size,
        qsl, seq, r, hq, hkv, d, scale, sliding_window or 0, soft_cap or 0.0,
        out.data_ptr(),
    )  # fmt: skip
    if code != 0:
        raise ValueError(f"attention_rows: {_ERRORS.get(code, f'error {code}')}")
    return out


def attention_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_table: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, sliding_window: int | None, soft_cap: float | None,
) -> torch.Tensor:  # fmt: skip
    """`rows_step` then `attention_rows_step`: one call's layout checked and used once."""
    step = rows_step(slot_mapping, block_table, query_start_loc, seq_lens)
    return attention_rows_step(
        step, query, key, value, key_cache, value_cache, scale, sliding_window, soft_cap
    )
