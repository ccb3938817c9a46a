"""GGUF blocks -> qgemm's native tiles in one C pass (qgemm_repack.c), and rows back out.

    repack_gguf(lib, type_name, parts, cols)   the rows of one or more GGUF tensors
                                               (numpy uint8 [rows, bytes a row], in
                                               order) as one QGemm, or None where the
                                               old packers must decide (below)
    lookup_rows(gemm, ids)                     float32 rows of any packed weight
                                               (an embedding's lookup)

The loader used to decode every tensor to codes and float32 scales and pack those
in torch on one thread (packing_native.py searching for the sub-scales the file
stores); a 1-2B model spent most of its start-up there (docs/cpu-startup.md).
The tiles hold the same float32 values, so every kernel gives the same bits.
None (the caller keeps the old path) where the old packers would choose another
layout: a non-finite f16 scale, a Q4_1 / Q4_K tensor whose every offset is -8
times its scale (Q4_0's form), a Q5_K tensor with no code above 15.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from paged.runner.cpu_kernels.build import QGemmLibrary
from paged.runner.cpu_kernels.packing_native import (
    FMT_Q4K,
    FMT_Q5K,
    FMT_Q6K,
    FMT_Q40,
    FMT_Q41,
    FMT_Q80,
    native_nbytes,
)
from paged.runner.cpu_kernels.qgemm import QGemm

# GGUF type name -> (ggml type number, weights a block, bytes a block, tile format)
GGUF_TYPES: dict[str, tuple[int, int, int, int]] = {
    "Q4_0": (2, 32, 18, FMT_Q40),
    "Q4_1": (3, 32, 20, FMT_Q41),
    "Q5_0": (6, 32, 22, FMT_Q80),
    "Q8_0": (8, 32, 34, FMT_Q80),
    "Q4_K": (12, 256, 144, FMT_Q4K),
    "Q5_K": (13, 256, 176, FMT_Q5K),
    "Q6_K": (14, 256, 210, FMT_Q6K),
}
_NONFINITE, _NOT_Q40, _CODE_PAST_15 = 1, 2, 4


def repack_gguf(
    lib: QGemmLibrary, type_name: str, parts: Sequence[tuple[str, np.ndarray]], cols: int
) -> QGemm | None:
    """QGemm of the rows of `parts` ((tensor name, uint8 [rows, bytes a row]) in order).

    ValueError naming the tensor when its bytes do not hold whole rows of `cols`
    weights of `type_name` (a truncated or corrupt file); None where the fast path
    declines (module docstring) or the type has no tile format here.
    """
    spec = GGUF_TYPES.get(type_name)
    if spec is None:
        return None
    gtype, block, block_bytes, fmt = spec
    if cols <= 0 or cols % block:
        raise ValueError(f"{type_name} rows of {cols} weights are not whole {block}-weight blocks")
    row_bytes = cols // block * block_bytes
    pointers: list[np.ndarray] = []  # each row's address
    arrays: list[np.ndarray] = []  # alive through the call (contiguous copies too)
    for name, data in parts:
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != row_bytes:
            raise ValueError(
                f"GGUF tensor {name!r}: {type_name} rows of {cols} weights take {row_bytes} "
                f"bytes, got an array of {data.dtype} {tuple(data.shape)}: the file is "
                "truncated or corrupt"
            )
        if data.strides[1] != 1:
            data = np.ascontiguousarray(data)
        index = np.arange(data.shape[0], dtype=np.int64)
        pointers.append(index * data.strides[0] + data.ctypes.data)
        arrays.append(data)
    rows = np.concatenate(pointers) if pointers else np.zeros(0, dtype=np.int64)
    n = int(rows.shape[0])
    if n == 0:
        return None
    packed = torch.empty(native_nbytes(fmt, n, cols), dtype=torch.uint8)
    flags = lib.repack(gtype, rows.ctypes.data, n, cols, packed.data_ptr())
    del arrays
    if flags < 0:
        raise RuntimeError(f"paged_qgemm_repack failed: code {flags} ({type_name} {n} x {cols})")
    if flags & _NONFINITE:
        return None
    if type_name in ("Q4_1", "Q4_K") and not flags & _NOT_Q40:
        return None
    if type_name == "Q5_K" and not flags & _CODE_PAST_15:
        return None
    return QGemm(lib, packed, fmt, (n, cols), 2 if fmt == FMT_Q6K else 1)


def lookup_rows(gemm: QGemm, ids: torch.Tensor) -> torch.Tensor:
    """float32 [*ids.shape, in] rows `ids` of a packed weight: q * d (+ m), the float32
    operations of the loader's codes and scales (negative ids count from the end).

    IndexError for an id outside the weight's rows.
    """
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), gemm.in_features)
    rc = gemm.lib.rows(
        gemm.fmt, gemm.packed.data_ptr(), gemm.out_features, gemm.in_features, gemm.sub,
        flat.data_ptr(), flat.numel(), out.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise IndexError(f"ids: an id is outside the table's {gemm.out_features} rows")
    return out.reshape(*ids.shape, gemm.in_features)
