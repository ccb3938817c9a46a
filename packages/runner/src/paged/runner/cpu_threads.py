"""How many threads a CPU engine uses, and the kernels' worker pool that runs them.

`resolve_cpu_threads` decides the count, first match wins:
  1. an explicit count (`paged serve --cpu-threads N`);
  2. VLLM_CPU_OMP_THREADS_BIND as a CPU list ("0-31", "0,2,4-7"; ranks separated by
     "|": local rank i takes the i-th list, as vLLM 0.33 does,
     vllm/utils/ompmultiprocessing.py:153-171): as many threads as CPUs in the
     list, and the process is bound to them;
  3. OMP_NUM_THREADS (vLLM overwrites it from the bind list; paged keeps honouring
     it, as before, so that a user's or a test's OMP_NUM_THREADS=1 still holds);
  4. "auto" (vLLM's default), "nobind" or unset: the physical cores this process
     may run on (os.sched_getaffinity, one logical CPU per core as vLLM's auto
     bind takes on x86), split evenly between the local ranks, less
     VLLM_CPU_NUM_OF_RESERVED_CPU when set. vLLM reserves one core per rank for
     its scheduler process by default; paged does not: its engine core and API
     server sleep while a step runs (on a 2-core machine the reservation would
     halve the step's cores).

`CpuThreads.start` applies the count: a CpuPool (cpu_kernels/pool.c) attached to
the quantised matmuls (qgemm.c, which the fused decoder layers and the LM head
call) and the CPU attention, with torch left at one thread for the glue around
them; without the quantised path (float32 weights), torch's intra-op threads. The kernels
split their work into small tasks taken from a shared counter, so a core
stalled by another process delays a step by its share, not by a whole static
slice; results do not depend on the thread count (tests/test_cpu_threads.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from paged.runner.cpu_kernels.pool import CpuPool, UsePool, load_pool_library

logger = logging.getLogger(__name__)

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
OMP_ENV = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadPlan:
    """The resolved thread count, the CPUs to bind to (None: leave the affinity), and why."""

    threads: int
    cpus: tuple[int, ...] | None
    source: str


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-2,4,7-8' -> (0, 1, 2, 4, 7, 8), sorted and unique; ValueError naming the variable."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(v) for v in part.split("-", 1))
                if lo > hi or lo < 0:
                    raise ValueError
                cpus.update(range(lo, hi + 1))
            else:
                cpu = int(part)
                if cpu < 0:
                    raise ValueError
                cpus.add(cpu)
        except ValueError:
            raise ValueError(
                f"{BIND_ENV}: expected 'auto', 'nobind' or CPU lists like '0-31' or "
                f"'0-15|16-31', got {text!r}"
            ) from None
    return tuple(sorted(cpus))


def physical_cores(cpus: set[int], sys_cpu: Path = Path("/sys/devices/system/cpu")) -> list[int]:
    """One logical CPU (the highest id) per physical core among `cpus`.

    Cores are told apart by (package, core id) from sysfs; CPUs without that
    information count as cores of their own.
    """
    cores: dict[tuple[str, str] | int, int] = {}
    for cpu in sorted(cpus):
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            key: tuple[str, str] | int = (
                (topo / "physical_package_id").read_text().strip(),
                (topo / "core_id").read_text().strip(),
            )
        except OSError:
            key = cpu
        cores[key] = cpu
    return sorted(cores.values())


def resolve_cpu_threads(
    explicit: int | None = None,
    *,
    local_rank: int = 0,
    local_world_size: int = 1,
    env: Mapping[str, str] | None = None,
    allowed: set[int] | None = None,
    sys_cpu: Path = Path("/sys/devices/system/cpu"),
) -> ThreadPlan:
    """The thread count for one local rank (see the module docstring for the order).

    ValueError for a count below 1, a malformed variable or a bind list with fewer
    entries than ranks.
    """
    env = os.environ if env is None else env
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local_rank must be in [0, {local_world_size}), got {local_rank}")
    if explicit is not None:
        if isinstance(explicit, bool) or explicit < 1:
            raise ValueError(f"cpu_threads must be a positive integer, got {explicit!r}")
        return ThreadPlan(explicit, None, "--cpu-threads")
    bind = env.get(BIND_ENV, "auto").strip()
    if bind not in ("", "auto", "nobind"):
        lists = bind.split("|")
        if len(lists) < local_world_size:
            raise ValueError(
                f"{BIND_ENV}={bind!r} gives {len(lists)} CPU list(s) for "
                f"{local_world_size} local rank(s)"
            )
        cpus = parse_cpu_list(lists[local_rank])
        return ThreadPlan(len(cpus), cpus, BIND_ENV)
    omp = env.get(OMP_ENV, "").strip()
    if omp:
        try:
            threads = int(omp.split(",")[0])  # OpenMP allows a per-level list
        except ValueError:
            raise ValueError(f"{OMP_ENV} must be a positive integer, got {omp!r}") from None
        if threads < 1:
            raise ValueError(f"{OMP_ENV} must be a positive integer, got {omp!r}")
        return ThreadPlan(threads, None, OMP_ENV)
    usable = allowed if allowed is not None else os.sched_getaffinity(0)
    cores = physical_cores(usable, sys_cpu)
    share = len(cores) // local_world_size
    mine = cores[local_rank * share : (local_rank + 1) * share] if share else cores[:1]
    reserved = env.get(RESERVED_ENV, "").strip()
    if reserved:
        try:
            count = int(reserved)
        except ValueError:
            raise ValueError(f"{RESERVED_ENV} must be an integer, got {reserved!r}") from None
        mine = mine[: max(1, len(mine) - max(0, count))]
    return ThreadPlan(max(1, len(mine)), None, f"{BIND_ENV}={bind or 'auto'}")


class CpuThreads:
    """The engine's CPU threads: torch's intra-op count and the kernels' CpuPool.

    Owned by the worker; `close()` (at shutdown) detaches and joins the pool.
    """

    def __init__(self, plan: ThreadPlan, pool: CpuPool | None) -> None:
        self.plan = plan
        self.pool = pool

    @classmethod
    def start(cls, plan: ThreadPlan, *, kernels: bool = True) -> CpuThreads:
        """Bind (when the plan says), set torch's threads, and start the pool for the C
        kernels (kernels=False, or no compiler: no pool, the kernels run on one thread)."""
        if plan.cpus is not None:
            try:
                os.sched_setaffinity(0, plan.cpus)
            except OSError as exc:
                raise ValueError(
                    f"{BIND_ENV}: cannot bind to CPUs {list(plan.cpus)} ({exc.strerror}); "
                    f"this process may use {sorted(os.sched_getaffinity(0))}"
                ) from None
        pool = None
        if kernels and plan.threads > 1 and load_pool_library() is not None:
            pool = CpuPool(plan.threads)
            for use_pool in _kernel_setters():
                pool.attach(use_pool)
        # With the pool, torch runs only the step's glue (embedding rows, sampling):
        # one thread, because its OpenMP barrier waits for every thread and, on a
        # loaded machine, a descheduled one (SmolLM2-135M decode at 2 threads, load
        # 6-9: 0.44x one thread with torch at 2 threads, 0.74x with torch at 1).
        torch.set_num_threads(1 if pool is not None else plan.threads)
        logger.info(
            "CPU threads: %d (%s)%s",
            plan.threads,
            plan.source,
            "" if pool is not None or plan.threads == 1 else "; C kernels on one thread",
        )
        return cls(plan, pool)

    def close(self) -> None:
        """Detach the pool from the kernels and join its threads (idempotent)."""
        if self.pool is not None:
            self.pool.close()


def _kernel_setters() -> list[UsePool]:
    """The use_pool setters of the kernel libraries that load here."""
    from paged.runner.cpu_kernels.build import load_qgemm
    from paged.runner.cpu_step import attention_ops

    setters: list[UsePool] = []
    qgemm = load_qgemm()
    if qgemm is not None:
        setters.append(qgemm.use_pool)
    if attention_ops.load_attention_ops() is not None:
        setters.append(attention_ops.use_pool)
    return setters
