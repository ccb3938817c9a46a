"""The default number of torch intra-op threads for CPU inference.

Measured on this 2-core machine while other jobs kept it loaded (load average
7-14): SmolLM2-135M on the quantised path decoded 3.7-5.8 tok/s with one
thread, and with two threads did not finish 260 tokens in 400 s: every GEMM
split over two OpenMP threads waits for the slower one, and a core taken by
another process stalls it 30-60x. One thread never waits for a sibling.
An idle machine could not be measured in this session (it never was), so the
gain of two threads when both cores are free is not known here; set
OMP_NUM_THREADS to choose (it is always respected).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

DEFAULT_CPU_THREADS = 1


def apply_default_cpu_threads() -> int:
    """Use DEFAULT_CPU_THREADS unless OMP_NUM_THREADS chooses; returns the count in effect."""
    if os.environ.get("OMP_NUM_THREADS"):
        threads = torch.get_num_threads()
        logger.info("CPU threads: %d (OMP_NUM_THREADS)", threads)
        return threads
    torch.set_num_threads(DEFAULT_CPU_THREADS)
    logger.info(
        "CPU threads: %d (default; set OMP_NUM_THREADS to change, see paged.runner.cpu_threads)",
        DEFAULT_CPU_THREADS,
    )
    return DEFAULT_CPU_THREADS
