"""Compile qgemm.c with the system C compiler on first use and load it with ctypes.

The shared object goes to a cache directory keyed by a hash of the source,
the compiler (its path and `--version`) and the flags:
    $PAGED_KERNEL_CACHE, else $XDG_CACHE_HOME/paged/kernels, else ~/.cache/paged/kernels
It is compiled to a temporary name and renamed into place (atomic on POSIX),
so two processes compiling at once both end with a complete file. No torch
or Python headers are needed: a compile takes well under a second.

$PAGED_QGEMM_ISA picks the code path: "native" (default: the best the
compiling CPU has, `-march=native`), "avx2", "scalar" (force the lower paths,
for tests and comparisons) or "off" (never build: use torch's kernels).
$CC picks the compiler (default `cc`). Any failure (no compiler, a failed
compile, a load error) logs one line and returns None; the caller falls back.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

ISA_ENV = "PAGED_QGEMM_ISA"
CACHE_ENV = "PAGED_KERNEL_CACHE"
ISAS = ("native", "avx2", "scalar")
_ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512-vnni"}
_ABI = 3  # paged_qgemm_abi() of the source this module drives
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


def cache_dir() -> Path:
    """Where compiled kernels are kept (created on demand)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "paged" / "kernels"


def source_text() -> str:
    """qgemm.c, shipped as package data of paged-runner."""
    return resources.files("paged.runner.cpu_kernels").joinpath("qgemm.c").read_text()


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
        lib = ctypes.CDLL(str(path))
        _declare(lib)
        if lib.paged_qgemm_abi() != _ABI:
            raise OSError(f"{path} has ABI {lib.paged_qgemm_abi()}, expected {_ABI}")
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.warning("qgemm C kernel unavailable (%s); using torch's int4/int8 kernels", first)
        return None
    return QGemmLibrary(lib, _ISA_NAMES.get(lib.paged_qgemm_isa(), "unknown"), path)


def _compiled(isa: str, cc: str) -> Path:
    """The cached shared object for (source, compiler, flags), compiling it if absent."""
    compiler = shutil.which(cc)
    if compiler is None:
        raise OSError(f"no C compiler {cc!r} on PATH")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    source = source_text()
    flags = [*_BASE_FLAGS, *_FORCE[isa]]
    digest = hashlib.sha256("\0".join([source, compiler, version, *flags]).encode()).hexdigest()
    target = cache_dir() / f"qgemm-{isa}-{digest[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        src = Path(tmp) / "qgemm.c"
        src.write_text(source)
        out = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *flags, str(src), "-o", str(out), "-lm"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if done.returncode != 0:
            raise OSError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[:300]}")
        os.replace(out, target)  # atomic: a concurrent build's rename just wins or loses
    logger.info("qgemm: compiled %s (%s path)", target, isa)
    return target


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
