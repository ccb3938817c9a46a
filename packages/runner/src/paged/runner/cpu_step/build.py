"""Compile step_ops.c on first use (`cc -O3 -march=native`) and load it with ctypes.

Compiling and caching is `paged.runner.c_compile` (cache under
$PAGED_KERNEL_CACHE, else $XDG_CACHE_HOME/paged/kernels; atomic rename), so a
later start loads it without compiling.

$PAGED_CPU_STEP_OPS=off never builds (the torch ops run instead); $CC picks the
compiler (default `cc`). Any failure (no compiler, a failed compile, a load
error, an ABI mismatch) logs one warning and returns None: callers fall back.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path

from paged.runner.c_compile import (
    CACHE_ENV,
    compiled_library,
    first_line,
    open_checked,
    package_source,
)

logger = logging.getLogger(__name__)

ENABLE_ENV = "PAGED_CPU_STEP_OPS"
__all__ = ["CACHE_ENV", "ENABLE_ENV", "enabled", "forget", "load_step_ops"]
_ABI = 1  # paged_step_ops_abi() of the source this module drives
# -ffp-contract=off: no a*b - c*d -> fma, so the rotary's float32 arithmetic is
# the reference's operation for operation (bit-identical results, tested).
_FLAGS = [
    "-O3", "-march=native", "-ffp-contract=off", "-fopenmp-simd", "-fno-math-errno",
    "-shared", "-fPIC", "-std=c11",
    "-Werror=implicit-function-declaration", "-Wl,--no-undefined",
]  # fmt: skip

_loaded: dict[str, ctypes.CDLL | None] = {}
_default: list[ctypes.CDLL | None] = []  # load_step_ops()'s answer once decided


def enabled() -> bool:
    """False when $PAGED_CPU_STEP_OPS is "off"/"0"/"false" (ValueError for other values)."""
    value = os.environ.get(ENABLE_ENV, "on").strip().lower()
    if value in ("", "on", "1", "true"):
        return True
    if value in ("off", "0", "false"):
        return False
    raise ValueError(f"{ENABLE_ENV} must be on or off, got {value!r}")


def load_step_ops(compiler: str | None = None) -> ctypes.CDLL | None:
    """The loaded library (compiled if needed), or None if disabled or unavailable.

    The environment is read on the first call only (the step calls this
    ~10 times a layer; `forget()` makes the next call read it again). The
    result is kept per compiler: later calls cost a dict lookup.
    """
    if compiler is None:
        if _default:
            return _default[0]
        lib = _load(os.environ.get("CC") or "cc") if enabled() else None
        _default.append(lib)
        return lib
    return _load(compiler) if enabled() else None


def forget() -> None:
    """Read $PAGED_CPU_STEP_OPS / $CC again at the next `load_step_ops()` (tests)."""
    _default.clear()


def _load(cc: str) -> ctypes.CDLL | None:
    if cc not in _loaded:
        _loaded[cc] = _build_and_load(cc)
    return _loaded[cc]


def _build_and_load(cc: str) -> ctypes.CDLL | None:
    try:
        path = _compiled(cc)
        lib = open_checked(path, "paged_step_ops_abi", _ABI)
        _declare(lib)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU step ops unavailable (%s); using torch ops", first_line(exc))
        return None
    return lib


def _compiled(cc: str) -> Path:
    """The cached shared object for this source, compiler and flags."""
    source = package_source("paged.runner.cpu_step", "step_ops.c")
    return compiled_library(cc, source, "step_ops.c", "step_ops", _FLAGS)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.paged_step_ops_abi.restype = c_int
    signatures: dict[str, list[type]] = {
        "paged_set_sum_width": [c_int],
        "paged_sum_squares": [ptr, i64, i64, ptr],
        "paged_rms_norm": [ptr, c_int, i64, ptr, f32, ptr, i64, i64],
        "paged_add_rms_norm": [ptr, i64, ptr, ptr, f32, ptr, i64, i64],
        "paged_gated_act": [ptr, i64, ptr, i64, i64, c_int],
        "paged_rotary_neox": [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i64],
    }  # fmt: skip
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype = c_int
        fn.argtypes = argtypes
