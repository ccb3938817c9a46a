"""Compile fused_layer.c on first use and load it with ctypes (as build.py does for step_ops.c).

The fused library calls step_ops.c's and qgemm.c's exported functions through
pointers it is given, so it loads only when both of those did. Off when
$PAGED_CPU_STEP_OPS is off (every C step op off) or $PAGED_CPU_FUSED_LAYERS
is off (only the fusion: the per-op C path runs, for A/B measurements).
Any failure logs one warning and returns None: the model keeps its per-op path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess

from paged.runner.c_compile import compiled_library, first_line, open_checked, package_source
from paged.runner.cpu_step import build

logger = logging.getLogger(__name__)

ENABLE_ENV = "PAGED_CPU_FUSED_LAYERS"
_ABI = 3  # paged_fused_abi() of the source this module drives
_FLAGS = [
    "-O3", "-march=native", "-shared", "-fPIC", "-std=c11",
    "-Werror=implicit-function-declaration", "-Wl,--no-undefined",
]  # fmt: skip
_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    """False when $PAGED_CPU_FUSED_LAYERS or $PAGED_CPU_STEP_OPS says off (ValueError if neither
    on nor off)."""
    value = os.environ.get(ENABLE_ENV, "on").strip().lower()
    if value not in ("", "on", "1", "true", "off", "0", "false"):
        raise ValueError(f"{ENABLE_ENV} must be on or off, got {value!r}")
    return value not in ("off", "0", "false") and build.enabled()


def load_fused() -> ctypes.CDLL | None:
    """The loaded library (compiled if needed), or None if disabled or unavailable.

    Read at every call (a model asks once, when it builds its fused stack).
    """
    if not enabled():
        return None
    cc = os.environ.get("CC") or "cc"
    if cc not in _loaded:
        _loaded[cc] = _build_and_load(cc)
    return _loaded[cc]


def _build_and_load(cc: str) -> ctypes.CDLL | None:
    try:
        source = package_source("paged.runner.cpu_step", "fused_layer.c")
        path = compiled_library(cc, source, "fused_layer.c", "fused_layer", _FLAGS)
        lib = open_checked(path, "paged_fused_abi", _ABI)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("fused CPU layers unavailable (%s); using the per-op path", first_line(exc))
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name, argtypes in {
        # plan, m, pending, positions, token_slots (LoRA; None: no LoRA rows)
        "paged_fused_pre_attention": [ptr, i64, ptr, ptr, ptr],
        "paged_fused_post_attention": [ptr, i64, ptr, ptr],  # plan, m, attention output, slots
    }.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return lib
