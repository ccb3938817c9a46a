"""The KV cache budget of a CPU engine when `--kv-cache-memory` does not give one.

On CPU there is no device memory to profile, so the budget is decided before the
model loads, first match wins:
  1. VLLM_CPU_KVCACHE_SPACE=N: N GiB (vLLM 0.33's setting, vllm/platforms/cpu.py:341-344;
     0 or empty: not set);
  2. DEFAULT_CPU_KV_SHARE (a quarter) of the memory available now (MemAvailable in
     /proc/meminfo), at least MIN_CPU_KV_BYTES: ~5.5 GiB on a 24 GiB machine, which holds
     a SmolLM2-1.7B request at its native 8,192 tokens (1.5 GiB) and leaves the rest for
     the weights, the activations and other processes.
vLLM itself gives `--gpu-memory-utilization` a CPU meaning (a fraction of the node's
memory for weights and KV, vllm/v1/worker/cpu_worker.py:78-82, 218-245); paged's CPU
budget is fixed before loading, so that flag is ignored on CPU, with a warning.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KV_SHARE = 0.25
MIN_CPU_KV_BYTES = 1 << 30
GIB = 1 << 30


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where there is none (not Linux)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def cpu_kv_cache_bytes(
    env: Mapping[str, str] | None = None, meminfo: Path = Path("/proc/meminfo")
) -> tuple[int, str]:
    """(budget in bytes, where it came from) for a CPU engine without --kv-cache-memory.

    ValueError naming VLLM_CPU_KVCACHE_SPACE when it is not a non-negative integer.
    """
    env = os.environ if env is None else env
    space = env.get(KVCACHE_SPACE_ENV, "").strip()
    if space:
        try:
            gib = int(space)
        except ValueError:
            gib = -1
        if gib < 0:
            raise ValueError(f"{KVCACHE_SPACE_ENV} must be a whole number of GiB, got {space!r}")
        if gib > 0:
            return gib * GIB, f"{KVCACHE_SPACE_ENV}={gib}"
    available = available_memory_bytes(meminfo)
    if available is None:
        return MIN_CPU_KV_BYTES, "default (available memory unknown)"
    share = max(MIN_CPU_KV_BYTES, int(available * DEFAULT_CPU_KV_SHARE))
    return share, f"{DEFAULT_CPU_KV_SHARE:g} of {available / GIB:.1f} GiB available"
