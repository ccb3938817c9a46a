"""The CPU attention call of one layer alone, against torch SDPA on the same shapes (JSON).

Shapes are the default model's (SmolLM2-135M: 9 query heads, 3 KV heads, head
size 64, blocks of 16, bf16 cache): R requests with `keys` keys each and
q rows per request (1: plain decode; 8: a speculative verification step of
7 drafts + the bonus). Implementations, each timed per call (median of
rounds, each round the mean of `--calls` calls):

    c        paged's C call, cache write + attention (cpu_step/attention.c), the
             step's layout checked once outside the timing (as the model's layers share it);
             on a checkout before it (PYTHONPATH=<checkout>/packages/runner/src)
             the older one-query kernel (ops.decode_attention, q == 1 only)
    torch    the torch backend's fallback path: reshape_and_cache + paged_attention
             (block gathers, mask, SDPA in float32 for decode rows, one bf16
             SDPA per request for multi-row ones)
    sdpa     F.scaled_dot_product_attention alone on dense, pre-gathered float32
             tensors: the arithmetic of SDPA without paging (a floor for it)

Replaying a call rewrites the same K/V into the same slots: the cache is unchanged.

    OMP_NUM_THREADS=1 .venvs/all/bin/python benchmarks/cpu_attention_bench.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from paged.runner.attention import torch_attention

BF16 = torch.bfloat16
HQ, HKV, D, BLOCK = 9, 3, 64, 16


def _c_impl() -> tuple[str, Callable[..., torch.Tensor] | None]:
    try:
        from paged.runner.cpu_step import attention_ops
    except ImportError:  # an older checkout: the one-query kernel of step_ops.c
        from paged.runner.cpu_step import ops as old_ops

        def old(case: dict[str, Any]) -> torch.Tensor:
            if case["q_rows"] != 1:  # main() never asks: it times this kernel at one row only
                raise ValueError("the one-query kernel takes one query row per request")
            if "old_step" not in case:  # checked once per step, as the model does
                case["old_step"] = old_ops.decode_step(  # type: ignore[attr-defined]
                    case["slots"], case["table"], case["seq_lens"]
                )
            return old_ops.decode_attention_step(  # type: ignore[attr-defined, no-any-return]
                case["old_step"], case["q"], case["k"], case["v"], case["kc"], case["vc"],
                0.125, None, None,
            )  # fmt: skip

        return "c_one_query_kernel", old
    if not attention_ops.available():
        return "c", None

    def new(case: dict[str, Any]) -> torch.Tensor:
        if "step" not in case:  # checked once per step, as the model does
            case["step"] = attention_ops.rows_step(
                case["slots"], case["table"], case["qsl"], case["seq_lens"]
            )
        return attention_ops.attention_rows_step(
            case["step"], case["q"], case["k"], case["v"], case["kc"], case["vc"],
            0.125, None, None,
        )  # fmt: skip

    return "c_rows", new


def _case(r: int, keys: int, q_rows: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    width = -(-keys // BLOCK)
    num_blocks = r * width + 1
    table = torch.randperm(num_blocks, generator=gen)[: r * width].view(r, width).to(torch.int32)
    t = r * q_rows
    slots = torch.tensor(
        [int(table[i, p // BLOCK]) * BLOCK + p % BLOCK
         for i in range(r) for p in range(keys - q_rows, keys)]
    )  # fmt: skip
    kc = torch.randn(num_blocks, BLOCK, HKV, D, generator=gen).to(BF16)
    vc = torch.randn(num_blocks, BLOCK, HKV, D, generator=gen).to(BF16)
    return {
        "q_rows": q_rows, "kc": kc, "vc": vc, "table": table, "slots": slots,
        "q": torch.randn(t, HQ * D, generator=gen).to(BF16),
        "k": torch.randn(t, HKV * D, generator=gen).to(BF16),
        "v": torch.randn(t, HKV * D, generator=gen).to(BF16),
        "qsl": torch.arange(0, t + 1, q_rows, dtype=torch.int32),
        "seq_lens": torch.full((r,), keys, dtype=torch.int32),
        # dense float32 copies for bare SDPA: [R, Hkv, S, D] and queries [R, Hkv, q*G, D]
        "dense_k": _dense(kc, table, keys), "dense_v": _dense(vc, table, keys),
    }  # fmt: skip


def _dense(cache: torch.Tensor, table: torch.Tensor, keys: int) -> torch.Tensor:
    r = table.shape[0]
    rows = cache[table.long()].view(r, table.shape[1] * BLOCK, HKV, D)[:, :keys]
    return rows.transpose(1, 2).float()


def _torch_path(case: dict[str, Any]) -> torch.Tensor:
    t = case["q"].shape[0]
    torch_attention.reshape_and_cache(
        case["k"].view(t, HKV, D), case["v"].view(t, HKV, D), case["kc"], case["vc"], case["slots"]
    )
    return torch_attention.paged_attention(
        case["q"].view(t, HQ, D), case["kc"], case["vc"], case["table"], case["qsl"],
        case["seq_lens"], 0.125, max_query_len=case["q_rows"],
        max_seq_len=int(case["seq_lens"].max()),
    )  # fmt: skip


def _bare_sdpa(case: dict[str, Any]) -> torch.Tensor:
    r, q_rows = case["seq_lens"].shape[0], case["q_rows"]
    q = case["q"].view(r, q_rows, HKV, HQ // HKV, D).permute(0, 2, 1, 3, 4)
    q = q.reshape(r, HKV, q_rows * (HQ // HKV), D).float()
    return F.scaled_dot_product_attention(q, case["dense_k"], case["dense_v"], scale=0.125)


def _time(fn: Callable[[], object], calls: int, rounds: int) -> float:
    fn()  # warm-up (compiles/loads)
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls)
    return statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--keys", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--q-rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    c_name, c_fn = _c_impl()
    for q_rows in args.q_rows:
        for r in args.batch_sizes:
            for keys in args.keys:
                case = _case(r, keys, q_rows, seed=r * 7919 + keys)
                line: dict[str, Any] = {
                    "batch": r, "keys": keys, "q_rows": q_rows,
                    "threads": torch.get_num_threads(),
                    "load_avg_before": round(os.getloadavg()[0], 2),
                }  # fmt: skip
                impls: dict[str, Callable[[], object]] = {
                    "torch": functools.partial(_torch_path, case),
                    "sdpa": functools.partial(_bare_sdpa, case),
                }
                if c_fn is not None and (q_rows == 1 or c_name == "c_rows"):
                    impls[c_name] = functools.partial(c_fn, case)
                for name, fn in impls.items():
                    line[f"{name}_us"] = round(1e6 * _time(fn, args.calls, args.rounds), 1)
                if f"{c_name}_us" in line:
                    c_us = line[f"{c_name}_us"]
                    line["torch_over_c"] = round(line["torch_us"] / c_us, 2)
                    line["sdpa_over_c"] = round(line["sdpa_us"] / c_us, 2)
                line["load_avg_after"] = round(os.getloadavg()[0], 2)
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
