"""Compile qgemm.c with the system C compiler on first use and load it with ctypes.

Compiling and caching is `paged.runner.c_compile` (cache under
$PAGED_KERNEL_CACHE, else $XDG_CACHE_HOME/paged/kernels; atomic rename).

$PAGED_QGEMM_ISA picks the code path: "native" (default: the best the
compiling CPU has, `-march=native`), "avx2", "scalar" (force the lower paths,
for tests and comparisons) or "off" (never build: use torch's kernels).
$CC picks the compiler (default `cc`). Any failure (no compiler, a failed
compile, a load error) logs one line and returns None; the caller falls back.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from paged.runner.c_compile import CACHE_ENV as CACHE_ENV  # re-exported: tests set it
from paged.runner.c_compile import cache_dir as cache_dir
from paged.runner.c_compile import (
    compiled_library,
    first_line,
    open_checked,
    package_source,
)

logger = logging.getLogger(__name__)

ISA_ENV = "PAGED_QGEMM_ISA"
ISAS = ("native", "avx2", "scalar")
_ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512-vnni"}
_ABI = 8  # paged_qgemm_abi() of the source this module drives
_FORCE = {
    "native": [],
    "avx2": ["-DPAGED_QGEMM_FORCE_AVX2"],
    "scalar": ["-DPAGED_QGEMM_FORCE_SCALAR"],
}
# -ffp-contract=off: no fused multiply-adds where the source has none, so that the
# activations' quantisation (and its residual) is the same float32 maths on every path.
_BASE_FLAGS = [
    "-O3",
    "-march=native",
    "-shared",
    "-fPIC",
    "-std=c11",
    "-ffp-contract=off",
    "-D_POSIX_C_SOURCE=200112L",
]

_LOADED: dict[tuple[str, str], QGemmLibrary | None] = {}


@dataclass(frozen=True)
class QGemmLibrary:
    """The loaded kernels; `isa` is the path compiled in ("avx512-vnni", "avx2", "scalar")."""

    lib: ctypes.CDLL
    isa: str
    path: Path

    def q4(self, *args: float) -> int:
        """paged_qgemm_q4(w, n, k, levels, ratio, x, m, x_stride, x_bf16, y, y_stride, y_bf16)."""
        return int(self.lib.paged_qgemm_q4(*args))

    def q8(self, *args: float) -> int:
        """paged_qgemm_q8(w, n, k, sub, levels, ratio, x, m, x_stride, x_bf16, y, y_stride,
        y_bf16)."""
        return int(self.lib.paged_qgemm_q8(*args))

    def native(self, *args: float) -> int:
        """paged_qgemm_native(fmt, w, n, k, levels, ratio, x, m, x_stride, x_bf16, y, y_stride,
        y_bf16): a weight in GGUF's own bytes (fmt 5 Q4_K, 6 Q6_K, 7 Q4_0, 11 Q5_K, ...;
        qgemm_native.c)."""
        return int(self.lib.paged_qgemm_native(*args))

    def expand(self, *args: float) -> int:
        """paged_qgemm_expand(fmt, w, n, k, out): a native weight as qgemm.c's float32-scale
        blocks (4-bit, or 8-bit with two scales per 32), for tests and reports."""
        return int(self.lib.paged_qgemm_expand(*args))

    def repack(self, *args: float) -> int:
        """paged_qgemm_repack(gguf_type, row_pointers, n, k, out): GGUF blocks as a native
        weight's tiles; the RP_* flags (>= 0) or a negative error (qgemm_repack.c)."""
        return int(self.lib.paged_qgemm_repack(*args))

    def rows(self, *args: float) -> int:
        """paged_qgemm_rows(fmt, w, n, k, sub, ids, m, out): float32 rows of a packed weight."""
        return int(self.lib.paged_qgemm_rows(*args))

    def quantize(self, *args: float) -> int:
        """paged_qgemm_quantize(x, x_bf16, m, k, levels, ratio, flip, scalar, q, xs, xsum,
        q2, xs2, xsum2, has2): the activations' codes, for tests (see qgemm_quantize.c)."""
        return int(self.lib.paged_qgemm_quantize(*args))

    def use_pool(self, run: int | None, pool: int | None, threads: int) -> None:
        """Run the kernels' tasks on a CpuPool (run: paged_pool_run's address, pool: its
        handle); None, None: on the calling thread (cpu_kernels/pool.py attaches)."""
        self.lib.paged_qgemm_use_pool(run, pool, threads)


_PART = re.compile(r'^#include "(qgemm_[a-z0-9_]+\.c)".*$', re.MULTILINE)


def inline_parts(text: str, read: Callable[[str], str]) -> str:
    """qgemm.c's `#include "qgemm_*.c"` lines replaced by those files (read(name)).

    c_compile builds one source text; the parts keep qgemm.c short. #line
    directives keep the compiler's messages pointing at the right file.
    """

    def part(match: re.Match[str]) -> str:
        line = text.count("\n", 0, match.start()) + 2
        return f'#line 1 "{match[1]}"\n{read(match[1])}\n#line {line} "qgemm.c"'

    return _PART.sub(part, text)


def source_text() -> str:
    """qgemm.c with its parts inlined, shipped as package data of paged-runner."""

    def read(name: str) -> str:
        return package_source("paged.runner.cpu_kernels", name)

    return inline_parts(read("qgemm.c"), read)


def requested_isa() -> str:
    """$PAGED_QGEMM_ISA, checked: one of ISAS or "off"."""
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in (*ISAS, "off"):
        raise ValueError(f"{ISA_ENV} must be one of {', '.join((*ISAS, 'off'))}, got {isa!r}")
    return isa


def load_qgemm(isa: str | None = None, compiler: str | None = None) -> QGemmLibrary | None:
    """The kernels for `isa` (default $PAGED_QGEMM_ISA), compiled if needed; None on failure.

    The result is kept per (isa, compiler): later calls cost a dict lookup.
    """
    isa = requested_isa() if isa is None else isa
    if isa == "off":
        return None
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")
    cc = compiler or os.environ.get("CC") or "cc"
    key = (isa, cc)
    if key not in _LOADED:
        _LOADED[key] = _build_and_load(isa, cc)
    return _LOADED[key]


def _build_and_load(isa: str, cc: str) -> QGemmLibrary | None:
    try:
        path = _compiled(isa, cc)
        lib = open_checked(path, "paged_qgemm_abi", _ABI)
        _declare(lib)
        _declare_test_hooks(lib)
        _declare_repack(lib)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        logger.warning(
            "qgemm C kernel unavailable (%s); using torch's int4/int8 kernels", first_line(exc)
        )
        return None
    return QGemmLibrary(lib, _ISA_NAMES.get(lib.paged_qgemm_isa(), "unknown"), path)


def _compiled(isa: str, cc: str) -> Path:
    """The cached shared object for this source, compiler and ISA's flags."""
    path = compiled_library(
        cc, source_text(), "qgemm.c", f"qgemm-{isa}", [*_BASE_FLAGS, *_FORCE[isa]]
    )
    logger.debug("qgemm: %s (%s path)", path, isa)
    return path


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.paged_qgemm_isa.restype = c_int
    lib.paged_qgemm_abi.restype = c_int
    lib.paged_qgemm_q4.restype = c_int
    f32 = ctypes.c_float
    lib.paged_qgemm_q4.argtypes = [ptr, i64, i64, c_int, f32, ptr, i64, i64, c_int, ptr, i64, c_int]
    lib.paged_qgemm_q8.restype = c_int
    lib.paged_qgemm_q8.argtypes = [
        ptr,
        i64,
        i64,
        c_int,
        c_int,
        f32,
        ptr,
        i64,
        i64,
        c_int,
        ptr,
        i64,
        c_int,
    ]


def _declare_test_hooks(lib: ctypes.CDLL) -> None:
    """paged_qgemm_quantize (ABI 4 on): apart from _declare, which older sources'
    libraries (quant_kernel_bench --baseline-source) also go through."""
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.paged_qgemm_quantize.restype = c_int
    args: list[type[ctypes.c_int64 | ctypes.c_void_p | ctypes.c_int | ctypes.c_float]] = [
        ptr, c_int, i64, i64, c_int, ctypes.c_float, c_int, c_int,
    ]  # fmt: skip
    lib.paged_qgemm_quantize.argtypes = args + [ptr] * 7  # q, xs, xsum, q2, xs2, xsum2, has2
    lib.paged_qgemm_use_pool.restype = None  # ABI 5 on
    lib.paged_qgemm_use_pool.argtypes = [ptr, ptr, c_int]
    f32 = ctypes.c_float
    lib.paged_qgemm_native.restype = c_int  # ABI 6 on
    native: list[type[ctypes.c_int64 | ctypes.c_void_p | ctypes.c_int | ctypes.c_float]] = [
        c_int, ptr, i64, i64, c_int, f32, ptr, i64, i64, c_int, ptr, i64, c_int,
    ]  # fmt: skip
    lib.paged_qgemm_native.argtypes = native
    lib.paged_qgemm_expand.restype = c_int
    lib.paged_qgemm_expand.argtypes = [c_int, ptr, i64, i64, ptr]


def _declare_repack(lib: ctypes.CDLL) -> None:
    """paged_qgemm_repack and paged_qgemm_rows (ABI 8 on, qgemm_repack.c)."""
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.paged_qgemm_repack.restype = c_int
    lib.paged_qgemm_repack.argtypes = [c_int, ptr, i64, i64, ptr]
    lib.paged_qgemm_rows.restype = c_int
    lib.paged_qgemm_rows.argtypes = [c_int, ptr, i64, i64, c_int, ptr, i64, ptr]
