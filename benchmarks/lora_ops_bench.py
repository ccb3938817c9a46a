"""LoRA shrink/expand cost per decoder layer of the default model, against the base matmuls.

For each (rows T, distinct adapters, rank): the 7 LoRA targets of one SmolLM2-135M
layer (q, k, v, o, gate, up, down: hidden 576, kv width 192, intermediate 1536)
each run one ``lora_shrink`` and one ``lora_expand`` through ``paged.kernels.ops``
(the torch reference on CPU, Triton on CUDA), rows spread round-robin over the
adapters (the worst case: no two neighbouring rows share a slot) plus one base
row in 8. Reported next to the same layer's dense base matmuls in the same dtype
(``x @ W.T``; the quantized CPU path's own kernels differ, so read the ratio as an
order of magnitude), with the grouping computed once per layer (``groups=``, as
the runner does) and, for comparison, regrouped by every call. CPU figures are
process CPU time with one torch thread (a shared machine's load does not count).

On the CPU (float32/bfloat16) ``lora_c_us`` is the same layer's deltas as the runner
computes them there: four calls of the C kernel (cpu_kernels/lora_delta.c) on the
runner's stacked layouts (qkv: 3 slices, o, gate_up: 2 slices, down), B stored
transposed, every slot at the full rank.

Run: .venv/bin/python benchmarks/lora_ops_bench.py [--quick] [--device cpu|cuda]
Prints one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import platform
import time
from collections.abc import Callable

import torch

from paged.kernels import ops
from paged.kernels.lora import LoRARowGroups
from paged.runner.cpu_kernels.lora_delta import LoRADeltaPlan, load_lora_delta

HIDDEN, KV, INTER = 576, 192, 1536
# (in, out) of the 7 targets of one layer.
TARGETS = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN),
           (HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)]  # fmt: skip


def _time(device: torch.device, fn: Callable[[], object], iters: int) -> float:
    """Median seconds per call after a warm-up.

    CUDA: wall time, synchronised around each call. CPU: this process's CPU time
    (one thread), so other load on a shared machine does not count.
    """
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(clock() - t0)
    return sorted(times)[len(times) // 2]


def _layer(
    device: torch.device, dtype: torch.dtype, rows: int, adapters: int, rank: int, iters: int
) -> dict[str, float | int | None]:
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([-1 if t % 8 == 7 else t % adapters for t in range(rows)], device=device)
    weights = []
    for n_in, n_out in TARGETS:
        a = (torch.randn(adapters, rank, n_in, generator=gen) * 0.02).to(device, dtype)
        b = (torch.randn(adapters, n_out, rank, generator=gen) * 0.02).to(device, dtype)
        w = (torch.randn(n_out, n_in, generator=gen) * 0.02).to(device, dtype)
        x = torch.randn(rows, n_in, generator=gen).to(device, dtype)
        weights.append((x, a, b, w, torch.zeros(rows, n_out, device=device, dtype=dtype)))
    scaling = torch.ones(adapters, device=device)

    def lora(groups: LoRARowGroups | None) -> None:
        g = groups if groups is not None else ops.group_lora_rows(slots)
        for x, a, b, _, out in weights:
            y = ops.lora_shrink(x, a, slots, groups=g)
            ops.lora_expand(y, b, slots, out, 0, scaling, groups=g)

    def lora_regroup_each_call() -> None:
        for x, a, b, _, out in weights:
            y = ops.lora_shrink(x, a, slots)
            ops.lora_expand(y, b, slots, out, 0, scaling)

    def base() -> None:
        for x, _, _, w, _ in weights:
            torch.mm(x, w.t())

    base_s = _time(device, base, iters)
    lora_s = _time(device, lambda: lora(None), iters)
    c_kernel = _c_kernel(device, dtype, slots, adapters, rank, scaling)
    c_us = round(_time(device, c_kernel, iters) * 1e6, 1) if c_kernel is not None else None
    return {
        "rows": rows, "adapters": adapters, "rank": rank,
        "base_matmuls_us": round(base_s * 1e6, 1),
        "lora_us": round(lora_s * 1e6, 1),
        "lora_regroup_each_call_us": round(_time(device, lora_regroup_each_call, iters) * 1e6, 1),
        "lora_over_base": round(lora_s / base_s, 3),
        "lora_c_us": c_us,
    }  # fmt: skip


def _c_kernel(
    device: torch.device, dtype: torch.dtype, slots: torch.Tensor, adapters: int, rank: int,
    scaling: torch.Tensor,
) -> Callable[[], None] | None:  # fmt: skip
    """The runner's four C calls for one layer (None off the CPU, float16, no compiler)."""
    lib = load_lora_delta() if device.type == "cpu" and dtype != torch.float16 else None
    if lib is None:
        return None
    gen = torch.Generator().manual_seed(1)
    ranks = torch.full((adapters,), rank, dtype=torch.int64)
    rows = slots.shape[0]
    calls = []
    for n_in, offsets in ((HIDDEN, [0, HIDDEN, HIDDEN + KV, HIDDEN + 2 * KV]),
                          (HIDDEN, [0, HIDDEN]), (HIDDEN, [0, INTER, 2 * INTER]),
                          (INTER, [0, HIDDEN])):  # fmt: skip
        n = len(offsets) - 1
        a = (torch.randn(adapters, n * rank, n_in, generator=gen) * 0.02).to(dtype)
        bt = (torch.randn(adapters, n * rank, offsets[-1], generator=gen) * 0.02).to(dtype)
        plan = LoRADeltaPlan(lib, a, bt, scaling, ranks, offsets)
        x = torch.randn(rows, n_in, generator=gen).to(dtype)
        calls.append((plan, x, torch.zeros(rows, offsets[-1], dtype=dtype)))
    token_slots = slots.to(torch.int64)

    def run() -> None:
        for plan, x, out in calls:
            plan.add_to(x, out, token_slots)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    iters = 5 if args.quick else 20
    grid = [(32, n, r) for n in (1, 4, 8) for r in (8, 16, 64)] + [(512, 8, 16)]
    if args.quick:
        grid = [(32, 1, 16), (32, 8, 16), (512, 8, 16)]
    results = [_layer(device, dtype, t, n, r, iters) for t, n, r in grid]
    print(json.dumps({
        "device": str(device), "dtype": args.dtype, "backend": ops.get_backend(),
        "clock": "wall" if device.type == "cuda" else "process_cpu",
        "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
        "load_avg": os.getloadavg(), "per_layer": results,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
