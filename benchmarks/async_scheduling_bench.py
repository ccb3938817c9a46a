"""--async-scheduling (batch queue of 2) against the default step, same workload, one run.

Two offline engines (`LLM`) on the same model, one per mode, generate the same
greedy batch (`--requests` prompts of distinct text, `--tokens` new tokens
each, `ignore_eos`) in alternating rounds, so drift in machine load hits both
modes alike. Reports per mode the median (and min/max) tokens/s over
`--runs` rounds, whether the two modes produced identical tokens, the torch
thread count and the load average before and after.

Default model: SmolLM2-135M-Instruct (the shipped GGUF), on CPU in float32.

Run: .venv/bin/python benchmarks/async_scheduling_bench.py [--requests 8 --tokens 32 --runs 5]
Prints one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import time
from typing import Any

import torch

from paged.scheduler import SamplingParams
from paged.server.llm import LLM

WORDS = ("river", "stone", "cloud", "lantern", "orchard", "harbor", "meadow", "signal")


def prompts(n: int) -> list[str]:
    return [
        f"Write a short story about a {WORDS[i % len(WORDS)]} number {i} and the "
        f"{WORDS[(i + 3) % len(WORDS)]} that watched it."
        for i in range(n)
    ]


def one_round(llm: LLM, batch: list[str], tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, ids)) / elapsed, ids


def summary(rates: list[float]) -> dict[str, float]:
    return {
        "median_tokens_per_s": round(statistics.median(rates), 2),
        "min_tokens_per_s": round(min(rates), 2),
        "max_tokens_per_s": round(max(rates), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()
    load_before = os.getloadavg()
    common: dict[str, Any] = {
        "device": "cpu",
        "max_model_len": 512,
        "kv_cache_memory_bytes": 256 << 20,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        # The budget must cover one decode token per running request (vLLM's check).
        "max_num_seqs": min(256, args.max_num_batched_tokens),
    }
    engines = {
        "default": LLM(args.model, **common),
        "async_scheduling": LLM(args.model, async_scheduling=True, **common),
    }
    batch = prompts(args.requests)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for llm in engines.values():  # warm-up round, not timed
            one_round(llm, batch[:2], 4)
        for _ in range(args.runs):
            for name, llm in engines.items():
                rate, outputs[name] = one_round(llm, batch, args.tokens)
                rates[name].append(rate)
    finally:
        for llm in engines.values():
            llm.shutdown()
    result = {
        "bench": "async_scheduling",
        "model": args.model or "SmolLM2-135M-Instruct",
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "runs": args.runs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "same_tokens": outputs["default"] == outputs["async_scheduling"],
        **{name: summary(r) for name, r in rates.items()},
    }
    med = {name: statistics.median(r) for name, r in rates.items()}
    result["async_over_default"] = round(med["async_scheduling"] / med["default"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
