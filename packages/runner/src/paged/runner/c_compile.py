"""Compile one of the runner's C sources on first use, cached; shared by cpu_kernels and cpu_step.

The shared object goes to a cache directory keyed by a hash of the source, the
compiler (its path and `--version`), the flags and, with `-march=native`, what
"native" means on this host (the compiler's predefined macros under it: a cache
directory shared by machines with different CPUs, a home on NFS or a cache
carried to another VM, must not hand one machine a library built for another's
instruction set, which dies with SIGILL):
    $PAGED_KERNEL_CACHE, else $XDG_CACHE_HOME/paged/kernels, else ~/.cache/paged/kernels
It is compiled under a temporary name and renamed into place (atomic on POSIX),
so two processes compiling at once both end with a complete file. No torch or
Python headers are needed: a compile takes about a second.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "PAGED_KERNEL_CACHE"


def cache_dir() -> Path:
    """Where compiled kernels are kept (created on demand)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "paged" / "kernels"


def package_source(package: str, filename: str) -> str:
    """A C file shipped as package data of `package`."""
    return resources.files(package).joinpath(filename).read_text()


def compiled_library(cc: str, source: str, filename: str, stem: str, flags: list[str]) -> Path:
    """The cached shared object for (source, compiler, flags), compiling it if absent.

    `stem` names the file (`<stem>-<hash>.so`); OSError / SubprocessError on failure.
    """
    compiler = shutil.which(cc)
    if compiler is None:
        raise OSError(f"no C compiler {cc!r} on PATH")
    host = [_native_target(compiler)] if "-march=native" in flags else []
    key = [source, compiler, _version(compiler), *flags, *host]
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()
    target = cache_dir() / f"{stem}-{digest[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        src = Path(tmp) / filename
        src.write_text(source)
        out = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *flags, str(src), "-o", str(out), "-lm"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if done.returncode != 0:
            raise OSError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[:300]}")
        os.replace(out, target)  # atomic: a concurrent build's rename just wins or loses
    logger.info("compiled %s", target)
    return target


def open_checked(path: Path, abi_function: str, abi: int) -> ctypes.CDLL:
    """Load the shared object at `path`; OSError unless its `abi_function()` returns `abi`.

    The ABI number guards against a stale cached build of an older source.
    """
    lib = ctypes.CDLL(str(path))
    check = getattr(lib, abi_function)
    check.restype = ctypes.c_int
    found = check()
    if found != abi:
        raise OSError(f"{path} has ABI {found}, expected {abi}")
    return lib


@functools.cache
def _version(compiler: str) -> str:
    return subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout


@functools.cache
def _native_target(compiler: str) -> str:
    """What `-march=native` targets here: the compiler's predefined macros under it.

    They name the CPU family and every instruction-set extension the build may use
    (`__AVX512VNNI__`, `__znver4__`, ...), for gcc and clang alike.
    """
    done = subprocess.run(
        [compiler, "-march=native", "-E", "-dM", "-x", "c", os.devnull],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if done.returncode != 0:
        raise OSError(
            f"{compiler} failed ({done.returncode}) resolving -march=native: "
            f"{done.stderr.strip()[:300]}"
        )
    return "\n".join(sorted(done.stdout.splitlines()))


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when empty), for one-line logs."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
