"""paged's C kernel (qgemm) vs torch's int4 kernel vs a bf16 GEMM, per default-model layer.

For each layer shape of SmolLM2-135M (the default model; random codes and
scales of the right format, which do not change the kernels' speed) and each
row count M, the kernels compute y = x W^T with bfloat16 activations, the way
the quantised CPU path runs them. The activations are Gaussian with one channel
in 151 scaled by 30 (outlier channels, as real hidden states have: ~20% of the
groups take the second level here; 5-17% did at ratio 8 on the default model):

    qgemm      paged.runner.cpu_kernels as the layers run it (int8 activations per 32,
               a second int8 level for groups with amax > OUTLIER_RATIO x mean |x|)
    qgemm_1lvl one int8 level everywhere (llama.cpp's Q8 activations)
    int4pack   torch.ops.aten._weight_int4pack_mm_for_cpu (groups of 32); the Q8_0
               head runs it twice (high and low nibbles), as quantized_linear did
    bf16_mm    x @ W^T with a bfloat16 copy of the weight

Rounds alternate the kernels (A B C A B C ...) so that a change of machine load
hits all three; each figure is the median over rounds of the mean time of a
burst of calls. One JSON line per (layer, M), then a summary line; load average
and thread count recorded on every line.

    OMP_NUM_THREADS=1 .venvs/all/bin/python benchmarks/quant_kernel_bench.py
    .venvs/all/bin/python benchmarks/quant_kernel_bench.py --rows 1 32 --rounds 5 --isa avx2
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from paged.runner.c_compile import compiled_library
from paged.runner.cpu_kernels import QGemm, QGemmLibrary, build, load_qgemm
from paged.runner.layers.quantized_linear import OUTLIER_RATIO

# (name, out, in, format): SmolLM2-135M-Instruct's Q4_1 projections and its tied Q8_0 head.
LAYERS = [
    ("qkv_proj", 960, 576, "Q4_1"),
    ("o_proj", 576, 576, "Q4_1"),
    ("gate_up_proj", 3072, 576, "Q4_1"),
    ("down_proj", 576, 1536, "Q4_1"),
    ("lm_head", 49152, 576, "Q8_0"),
]


def _int4pack(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()

    def run(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
        return out

    return run


class Baseline:
    """Another version's qgemm.c (and its qgemm_*.c parts) and packing.py (a directory
    holding them, e.g. main's cpu_kernels/), built like this one, for before/after in
    one run. Its packed weights are driven through this version's QGemm.matmul, so that
    both sides pay the same Python overhead per call (it matters at one row: ~20-60 us
    calls)."""

    def __init__(self, source: Path, isa: str) -> None:
        flags = [*build._BASE_FLAGS, *build._FORCE[isa]]
        # qgemm.c and its parts (qgemm_*.c, if it has any), one translation unit
        text = build.inline_parts(
            (source / "qgemm.c").read_text(), lambda name: (source / name).read_text()
        )
        path = compiled_library("cc", text, "qgemm.c", "qgemm-base", flags)
        lib = ctypes.CDLL(str(path))
        build._declare(lib)
        self.lib = QGemmLibrary(lib, f"baseline-{isa}", path)
        spec = importlib.util.spec_from_file_location("baseline_packing", source / "packing.py")
        assert spec is not None and spec.loader is not None
        self.packing = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.packing)

    def gemm(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> QGemm:
        n, k = codes.shape
        if offset is not None:
            return QGemm(self.lib, self.packing.pack_q4(codes, scale, offset), 4, (n, k), 1)
        packed, sub = self.packing.pack_q8(codes, scale)
        return QGemm(self.lib, packed, 8, (n, k), sub)


def _cycle(
    fns: list[Callable[[torch.Tensor], torch.Tensor]],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Each call the next of fns (copies of one weight: see --copies)."""
    turn = itertools.cycle(fns)
    return lambda x: next(turn)(x)


def kernels(
    out: int, inp: int, fmt: str, isa: str, base: Baseline | None = None,
    copies: int = 1,
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:  # fmt: skip
    gen = torch.Generator().manual_seed(out * 7 + inp)
    groups = inp // 32
    lib = load_qgemm(isa)
    if lib is None:
        raise SystemExit("qgemm did not build (see the log line)")
    if fmt == "Q4_1":
        codes = torch.randint(0, 16, (out, inp), dtype=torch.uint8, generator=gen)
        scale = torch.rand(out, groups, generator=gen) * 0.01
        offset = -8 * scale + torch.randn(out, groups, generator=gen) * 1e-3
        scale, offset = scale.half().float(), offset.half().float()  # GGUF's are float16
        weight = codes.float() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)
        qs = [QGemm.int4(lib, codes, scale, offset) for _ in range(copies)]
        qbs = [base.gemm(codes, scale, offset) for _ in range(copies)] if base else []
        torch_int4 = _int4pack(codes, scale, offset + 8 * scale)
    else:
        codes8 = torch.randint(-127, 128, (out, inp), dtype=torch.int8, generator=gen)
        scale = torch.rand(out, groups, generator=gen) * 0.001
        scale = scale.half().float()
        weight = codes8.float() * scale.repeat_interleave(32, 1)
        qs = [QGemm.int8(lib, codes8, scale) for _ in range(copies)]
        qbs = [base.gemm(codes8, scale, None) for _ in range(copies)] if base else []
        high = _int4pack(
            ((codes8 >> 4) + 8).to(torch.uint8), 16 * scale, -128 * scale + 8 * 16 * scale
        )
        low = _int4pack((codes8 & 15).to(torch.uint8), scale, 8 * scale)

        def torch_int4(x: torch.Tensor) -> torch.Tensor:
            return high(x).float() + low(x).float()

    dense_t = weight.to(torch.bfloat16).t().contiguous()
    found: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "qgemm": _cycle([partial(q.matmul, outlier_ratio=OUTLIER_RATIO) for q in qs]),
        "qgemm_1lvl": _cycle([q.matmul for q in qs]),
        "int4pack": torch_int4,
        "bf16_mm": lambda x: x @ dense_t,
    }
    if qbs:
        found["qgemm_base"] = _cycle([partial(q.matmul, outlier_ratio=OUTLIER_RATIO) for q in qbs])
        found["qgemm_base_1lvl"] = _cycle([q.matmul for q in qbs])
    return found


KERNELS = ("qgemm", "qgemm_1lvl", "int4pack", "bf16_mm", "qgemm_base", "qgemm_base_1lvl")


def gops(m: int, out: int, inp: int, ms: float) -> float:
    """Integer/float operations per second (2 M N K per call), in GOP/s."""
    return 2.0 * m * out * inp / (ms * 1e-3) / 1e9


def time_burst(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, min_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> float:  # fmt: skip
    """Mean seconds per call over a burst lasting about min_s (of `clock`)."""
    calls, start = 0, clock()
    while True:
        fn(x)
        calls += 1
        elapsed = clock() - start
        if elapsed >= min_s and calls >= 3:
            return elapsed / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--burst-s", type=float, default=0.05)
    ap.add_argument("--layers", nargs="+", default=[name for name, *_ in LAYERS])
    ap.add_argument("--isa", default="native", choices=["native", "avx2", "scalar"])
    ap.add_argument(
        "--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS),
        help="which kernels to time (ratios need qgemm and the other one)",
    )  # fmt: skip
    ap.add_argument(
        "--head-max-rows", type=int, default=256,
        help="skip lm_head above this M (prefill takes logits at sampled rows only)",
    )  # fmt: skip
    ap.add_argument(
        "--baseline-source", type=Path, default=None,
        help="a directory with another version's qgemm.c and packing.py (e.g. main's "
        "cpu_kernels/, from git archive), timed alongside as qgemm_base[_1lvl]",
    )  # fmt: skip
    ap.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="cpu: this thread's CPU time (one torch thread: every kernel runs on it), "
        "which moves less than wall time when other processes share the cores",
    )  # fmt: skip
    ap.add_argument(
        "--copies", type=int, default=1,
        help="cycle through this many copies of each packed weight (qgemm kernels only), so "
        "that they stream from memory as a decode step's 30 layers do, not from cache",
    )  # fmt: skip
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    base = Baseline(args.baseline_source, args.isa) if args.baseline_source else None
    torch.manual_seed(0)
    totals: dict[int, dict[str, float]] = {}
    for name, out, inp, fmt in LAYERS:
        if name not in args.layers:
            continue
        ks = {
            k: v
            for k, v in kernels(out, inp, fmt, args.isa, base, args.copies).items()
            if k in args.kernels
        }
        for m in args.rows:
            if name == "lm_head" and m > args.head_max_rows:
                continue
            x = torch.randn(m, inp)
            x[:, ::151] *= 30.0
            x = x.to(torch.bfloat16)
            for fn in ks.values():
                fn(x)  # warm up (first-call allocations, caches)
            load_before = os.getloadavg()[0]
            times: dict[str, list[float]] = {k: [] for k in ks}
            for _ in range(args.rounds):
                for k, fn in ks.items():
                    times[k].append(time_burst(fn, x, args.burst_s, clock))
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            for k, v in med.items():
                totals.setdefault(m, {}).setdefault(k, 0.0)
                # 30 decoder layers of each projection, one head.
                totals[m][k] += v * (1 if name == "lm_head" else 30)
            print(json.dumps({
                "layer": name, "shape": [out, inp], "format": fmt, "rows": m,
                "ms_median": {k: round(v, 4) for k, v in med.items()},
                "gops": {k: round(gops(m, out, inp, v), 1) for k, v in med.items()},
                **{
                    f"{k}_over_qgemm": round(med[k] / med["qgemm"], 2)
                    for k in med if k != "qgemm" and "qgemm" in med
                },
                "threads": torch.get_num_threads(), "isa": args.isa, "clock": args.clock,
                "copies": args.copies,
                "load_avg_before": round(load_before, 2),
                "load_avg_after": round(os.getloadavg()[0], 2),
            }), flush=True)  # fmt: skip
    print(json.dumps({
        "summary": "ms per decode step's matmuls (30 layers x each projection + head)",
        "per_rows": {str(m): {k: round(v, 3) for k, v in t.items()} for m, t in totals.items()},
        "threads": torch.get_num_threads(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
