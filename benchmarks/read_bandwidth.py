"""STREAM-like read bandwidth: GB/s that 1, 2, ... threads reach reading a large array.

A decode step of a 1-8B model streams its weights once, so the machine's read
bandwidth caps the 1-stream decode rate (tok/s <= GB/s / weight GB); compare a
benchmark's decode figure with this one to state the fraction reached.

Each thread sums (64-bit integer adds, vectorised by the compiler, four
accumulators) its own contiguous share of a `--mib` MiB array, `--reps` times;
the array is far larger than the last-level cache and is touched once before
timing so that page faults are not counted. The C loop is compiled with the
runner's cached compiler helper (paged.runner.c_compile, -O3 -march=native) and
called through ctypes; each figure is the median of `--runs` runs.

    .venvs/all/bin/python benchmarks/read_bandwidth.py                  # 1 and 2 threads
    .venvs/all/bin/python benchmarks/read_bandwidth.py --threads 1,2,4 --mib 2048
Prints one JSON line: threads -> GB/s (10^9 bytes/s), runs, load average before/after.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics

import numpy as np

from paged.runner.c_compile import compiled_library

SOURCE = r"""
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef struct { const uint64_t *p; size_t n; int reps; uint64_t sum; } job_t;

static void *reader(void *arg) {
    job_t *job = (job_t *)arg;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (int r = 0; r < job->reps; r++) {
        const uint64_t *p = job->p;
        size_t i = 0;
        for (; i + 4 <= job->n; i += 4) { a += p[i]; b += p[i + 1]; c += p[i + 2]; d += p[i + 3]; }
        for (; i < job->n; i++) a += p[i];
    }
    job->sum = a + b + c + d;  /* kept: the loads cannot be dropped */
    return NULL;
}

/* Seconds for `threads` threads to each read their share of p[0..n) `reps` times. */
double read_seconds(const uint64_t *p, size_t n, int threads, int reps, uint64_t *sum) {
    pthread_t tid[256];
    job_t jobs[256];
    if (threads < 1 || threads > 256) return -1.0;
    size_t share = (n + threads - 1) / threads;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int t = 0; t < threads; t++) {
        size_t lo = (size_t)t * share < n ? (size_t)t * share : n;
        size_t hi = lo + share < n ? lo + share : n;
        jobs[t] = (job_t){p + lo, hi - lo, reps, 0};
        if (pthread_create(&tid[t], NULL, reader, &jobs[t]) != 0) return -1.0;
    }
    *sum = 0;
    for (int t = 0; t < threads; t++) { pthread_join(tid[t], NULL); *sum += jobs[t].sum; }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
"""


def _reader() -> ctypes._NamedFuncPointer:
    flags = ["-O3", "-march=native", "-shared", "-fPIC", "-pthread"]
    lib = ctypes.CDLL(str(compiled_library("cc", SOURCE, "read_bw.c", "read_bw", flags)))
    fn = lib.read_seconds
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                   ctypes.POINTER(ctypes.c_uint64)]  # fmt: skip
    return fn


def measure(mib: int, threads: list[int], reps: int, runs: int) -> dict[str, object]:
    """Median GB/s per thread count (a `mib` MiB array read `reps` times per run)."""
    if mib < 1 or reps < 1 or runs < 1 or min(threads) < 1:
        raise ValueError("mib, reps, runs and threads must be >= 1")
    array = np.arange(mib * (1 << 20) // 8, dtype=np.uint64)  # written once: pages mapped
    fn = _reader()
    total = ctypes.c_uint64()
    load_before = os.getloadavg()[0]
    results: dict[str, object] = {}
    for t in threads:
        rates = []
        for _ in range(runs):
            seconds = fn(array.ctypes.data, array.size, t, reps, ctypes.byref(total))
            if seconds <= 0:
                raise RuntimeError(f"read loop failed at {t} threads")
            rates.append(round(array.nbytes * reps / seconds / 1e9, 2))
        results[str(t)] = {"gb_s": statistics.median(rates), "runs": rates}
    return {
        "bench": "read_bandwidth", "mib": mib, "reps": reps,
        "cpus": len(os.sched_getaffinity(0)), "threads": results,
        "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="array size in MiB (>> LLC)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--reps", type=int, default=3, help="passes over the array per run")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads {args.threads!r}: comma-separated integers")
    try:
        print(json.dumps(measure(args.mib, threads, args.reps, args.runs)), flush=True)
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
