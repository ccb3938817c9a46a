"""One decode token's quantised matmuls of a GGUF model: GGUF-native vs float32-scale tiles.

Every 2-D weight of the file that the C kernel takes exactly (Q4_0/Q4_1/Q4_K/Q5_K,
Q8_0/Q5_0/Q6_K; the tied embedding when there is no output head) is packed twice:
`QGemm.int4/int8(..., native=True)` (qgemm_native.c: the file's byte count where
the format allows) and `native=False` (qgemm.c's float32-scale blocks, the layout
before; Q5_K has no such layout and stays FMT_Q5K in both). A "step" multiplies one
bfloat16 activation row by every weight, as one 1-stream decode token does
(outlier_ratio 4, the engine's setting); that is the qgemm share of a decode step
(85% in docs/cpu-threads-profile.md), without norms, attention, sampling or Python
glue. The layouts are alternated step by step, at 1 thread (no pool) and N threads
(a CpuPool attached to the kernels), and each figure is the median of `--steps`
steps, the load average beside it.

    .venvs/all/bin/python benchmarks/qgemm_native_bench.py --model random-smollm2-1.7b-Q4_K_M.gguf

Several files (--model A B, e.g. the same shape as Q4_K_M and Q5_K_M) are alternated
step by step too (--layouts native: only the native packing; requantised: Q5_K as
int8 groups of 32, paged's path before FMT_Q5K), so that their MB and GB/s compare
under the same load:

    .venvs/all/bin/python benchmarks/qgemm_native_bench.py --layouts native \
        --model random-smollm2-1.7b-Q4_K_M.gguf random-smollm2-1.7b-Q5_K_M.gguf

Prints one JSON line per (threads, file:layout): MB a step, ms a step (median),
GB/s (MB / ms), steps/s (the decode tok/s this share alone would allow).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import gguf
import torch

from paged.runner.cpu_kernels import QGemm, load_qgemm
from paged.runner.cpu_kernels.pool import CpuPool
from paged.runner.layers.quantized_linear import requantize_int8_groups
from paged.runner.loader.gguf_quant import GGUFQuantizedTensor


def _weights(path: str, layout: str) -> list[QGemm]:
    """The file's weights packed as `layout` ("native", "float32-scale" or "requantised":
    "native" with Q5_K re-quantised to int8 groups of 32, paged's path before FMT_Q5K)."""
    native = layout != "float32-scale"
    lib = load_qgemm()
    if lib is None:
        raise SystemExit("the qgemm C kernel did not build")
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    out = []
    for t in reader.tensors:
        if len(t.shape) != 2 or not (t.name.startswith("blk.") or t.name == head):
            continue
        cols = int(t.shape[0])
        tensor = GGUFQuantizedTensor(t.data, t.tensor_type, cols)
        g4 = tensor.int4_groups()
        if g4 is not None and layout == "requantised" and int(g4.codes.max()) > 15:
            exact = g4.codes.float() * g4.scale.repeat_interleave(32, 1)
            exact += g4.offset.repeat_interleave(32, 1)
            out.append(QGemm.int8(lib, *requantize_int8_groups(exact)))
            continue
        if g4 is not None:
            out.append(QGemm.int4(lib, g4.codes, g4.scale, g4.offset, native=native))
            continue
        g8 = tensor.int8_groups()
        if g8 is not None:
            out.append(QGemm.int8(lib, g8.codes, g8.scale, native=native))
    return out


def _step(weights: list[QGemm], xs: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for w in weights:
        w.matmul(xs[w.in_features], outlier_ratio=4.0)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, nargs="+", help="GGUF file(s)")
    parser.add_argument(
        "--layouts", nargs="+", default=["native", "float32-scale"],
        choices=["native", "float32-scale", "requantised"], help="packings to time",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=15, help="timed steps per layout")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layouts = {
        f"{os.path.basename(path)}:{layout}": _weights(path, layout)
        for path in args.model
        for layout in args.layouts
    }
    gen = torch.Generator().manual_seed(0)
    dims = {w.in_features for weights in layouts.values() for w in weights}
    xs = {k: torch.randn(1, k, generator=gen).bfloat16() for k in dims}
    lib = load_qgemm()
    assert lib is not None
    for threads in args.threads:
        pool = CpuPool(threads) if threads > 1 else None
        if pool is not None:
            pool.attach(lib.use_pool)
        times: dict[str, list[float]] = {name: [] for name in layouts}
        load0 = os.getloadavg()
        for weights in layouts.values():  # warm-up: page faults, first touches
            _step(weights, xs)
        for _ in range(args.steps):
            for name, weights in layouts.items():
                times[name].append(_step(weights, xs))
        load1 = os.getloadavg()
        if pool is not None:
            pool.close()
        for name, weights in layouts.items():
            mb = sum(w.nbytes for w in weights) / 1e6
            ms = statistics.median(times[name]) * 1e3
            row = {
                "threads": threads, "layout": name, "formats": sorted({w.fmt for w in weights}),
                "mb_per_step": round(mb, 1), "ms_per_step": round(ms, 2),
                "gb_s": round(mb / ms, 2), "steps_s": round(1e3 / ms, 2),
                "load_before": [round(v, 2) for v in load0],
                "load_after": [round(v, 2) for v in load1],
            }  # fmt: skip
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
