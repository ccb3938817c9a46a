"""CpuPool: the C kernels' persistent worker pool (pool.c), created once per engine process.

The kernels (qgemm.c, cpu_step/attention.c) split each call into small tasks
and run them through the pool a library was given with `attach`; a library
with no pool runs every task on the calling thread (the same results: a task
computes its outputs alone, in a fixed order). The pool's threads are plain
pthreads that spin briefly and then sleep between runs; they never run Python
and never take the GIL (ctypes releases it for the call).

Lifetime: `close()` (or leaving a `with` block) first detaches the pool from
every library it was attached to, then stops and joins its threads; a kernel
called afterwards runs on its caller's thread. Close only while no kernel call
is in flight (the engine closes it after its last step, at shutdown).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from collections.abc import Callable
from types import TracebackType

from paged.runner.c_compile import compiled_library, first_line, open_checked, package_source

logger = logging.getLogger(__name__)

_ABI = 1  # paged_pool_abi() of the source this module drives
_FLAGS = [
    "-O2", "-shared", "-fPIC", "-std=c11", "-pthread", "-D_GNU_SOURCE",
    "-Werror=implicit-function-declaration", "-Wl,--no-undefined",
]  # fmt: skip
_loaded: dict[str, ctypes.CDLL | None] = {}

# The setter each kernel library exports: use_pool(run function, pool handle, threads).
UsePool = Callable[[int | None, int | None, int], None]


def load_pool_library(compiler: str | None = None) -> ctypes.CDLL | None:
    """pool.c compiled (cached) and loaded; None (one warning) when it cannot be built."""
    cc = compiler or os.environ.get("CC") or "cc"
    if cc not in _loaded:
        _loaded[cc] = _build_and_load(cc)
    return _loaded[cc]


def _build_and_load(cc: str) -> ctypes.CDLL | None:
    try:
        source = package_source("paged.runner.cpu_kernels", "pool.c")
        path = compiled_library(cc, source, "pool.c", "pool", _FLAGS)
        lib = open_checked(path, "paged_pool_abi", _ABI)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning(
            "CPU kernel pool unavailable (%s); kernels run on one thread", first_line(exc)
        )
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.paged_pool_create.restype = ptr
    lib.paged_pool_create.argtypes = [ctypes.c_int]
    lib.paged_pool_destroy.restype = None
    lib.paged_pool_destroy.argtypes = [ptr]
    lib.paged_pool_threads.restype = ctypes.c_int
    lib.paged_pool_threads.argtypes = [ptr]
    lib.paged_pool_selftest.restype = ctypes.c_int
    lib.paged_pool_selftest.argtypes = [ptr, i64, ptr, i64, i64]
    return lib


class CpuPool:
    """A pool of `threads` participants: the thread calling a kernel and threads - 1 workers."""

    def __init__(self, threads: int, lib: ctypes.CDLL | None = None) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        lib = lib if lib is not None else load_pool_library()
        if lib is None:
            raise OSError("the CPU kernel pool library could not be built (see the log)")
        handle = lib.paged_pool_create(threads)
        if not handle:
            raise OSError(f"could not start a pool of {threads} threads")
        self._lib = lib
        self._handle: int | None = int(handle)
        self.threads = threads
        self._attached: list[UsePool] = []

    @property
    def handle(self) -> int:
        """The C pool pointer (for the kernels' use_pool setters); RuntimeError once closed."""
        if self._handle is None:
            raise RuntimeError("the CPU pool is closed")
        return self._handle

    @property
    def run_address(self) -> int:
        """The address of paged_pool_run, the function the kernels call."""
        return ctypes.cast(self._lib.paged_pool_run, ctypes.c_void_p).value or 0

    @property
    def closed(self) -> bool:
        return self._handle is None

    def attach(self, use_pool: UsePool) -> None:
        """Give a kernel library this pool (its use_pool setter); undone by close()."""
        use_pool(self.run_address, self.handle, self.threads)
        self._attached.append(use_pool)

    def selftest(self, out: ctypes.Array[ctypes.c_int64], fail_at: int, delay_us: int) -> int:
        """Run len(out) test tasks (pool.c's paged_pool_selftest): its return code."""
        return int(self._lib.paged_pool_selftest(self.handle, len(out), out, fail_at, delay_us))

    def close(self) -> None:
        """Detach from every library, then stop and join the workers (idempotent)."""
        if self._handle is None:
            return
        for use_pool in self._attached:
            use_pool(None, None, 1)
        self._attached.clear()
        handle, self._handle = self._handle, None
        self._lib.paged_pool_destroy(handle)

    def __enter__(self) -> CpuPool:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
