"""Data parallelism: output tokens/s of DP=N engines behind one AsyncLLM, against DP=1.

For each DP size the default model (SmolLM2-135M, or `--model`) is started
behind one `AsyncLLM` (`paged.server.data_parallel.open_async_llm`, the
engine client `paged serve --data-parallel-size N` uses), warmed up with one
request, then `--requests` greedy prompts of `--max-tokens` output tokens
each (ignore_eos) are submitted at once; the figure is generated tokens over
wall time from the first submit to the last finish, the median of
`--repeats` runs. `same_tokens` says whether every DP size produced DP=1's
tokens; `requests_per_engine` is each engine's own count (`get_stats`).

The load average is read before and after each figure, with the CPU count
and the torch threads each engine runs on (`OMP_NUM_THREADS`, default 1):
on a 2-core machine shared with other jobs two engines cannot double the
throughput, and a busy neighbour moves every figure.

Run:  python benchmarks/scaleout_dp.py [--sizes 1 2] [--requests 8] [--max-tokens 16]
Prints one JSON object. `benchmarks/scaleout_bench.py --part dp` imports `run_dp`.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # per engine process (inherited)

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from paged.scheduler import SamplingParams
from paged.server.data_parallel import DataParallelOptions, open_async_llm
from paged.server.engine_args import EngineArgs

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three uses of copper.",
    "Tell me a story about a robot.",
    "What is the capital of France and why?",
    "Describe a sunrise in the mountains.",
    "How do vaccines work?",
    "Give me a recipe for pancakes.",
]


def _load() -> float:
    return os.getloadavg()[0]


async def _generate_all(llm: Any, n: int, max_tokens: int, tag: str) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> list[int]:
        final = None
        prompt = PROMPTS[i % len(PROMPTS)] + f" ({i})"
        async for out in llm.generate(prompt, params, request_id=f"{tag}-{i}"):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _measure(
    size: int, args: EngineArgs, requests: int, max_tokens: int, repeats: int
) -> dict[str, Any]:
    started = time.perf_counter()
    llm = open_async_llm(args, DataParallelOptions(size=size))
    startup_s = time.perf_counter() - started
    try:
        await _generate_all(llm, 1, 4, "warmup")
        runs: list[dict[str, float]] = []
        tokens: list[list[int]] = []
        for r in range(repeats):
            load_before = _load()
            t0 = time.perf_counter()
            tokens = await _generate_all(llm, requests, max_tokens, f"run{r}")
            wall = time.perf_counter() - t0
            generated = sum(len(t) for t in tokens)
            runs.append(
                {
                    "output_tok_per_s": generated / wall,
                    "wall_s": wall,
                    "load_before": load_before,
                    "load_after": _load(),
                }
            )
        client = llm.engine_client
        if size > 1:
            per_engine = [
                (await client.call_utility_on(i, "get_stats")).num_requests_added  # type: ignore[attr-defined]
                for i in range(size)
            ]
        else:
            per_engine = [(await client.call_utility_async("get_stats")).num_requests_added]  # type: ignore[attr-defined]
        return {
            "dp_size": size,
            "output_tok_per_s_median": statistics.median(r["output_tok_per_s"] for r in runs),
            "runs": runs,
            "startup_s": startup_s,
            "requests_per_engine": per_engine,  # includes the warm-up request
            "tokens": tokens,
        }
    finally:
        llm.shutdown()


def run_dp(
    sizes: Sequence[int] = (1, 2),
    *,
    model: str | None = None,
    dtype: str = "float32",
    requests: int = 8,
    max_tokens: int = 16,
    repeats: int = 1,
) -> dict[str, Any]:
    """DP=N vs DP=1 output tok/s (medians), with loads, threads and token agreement."""
    if not sizes or sizes[0] != 1:
        raise ValueError(f"sizes must start with 1 (the reference), got {list(sizes)}")
    args = EngineArgs(model=model, device="cpu", dtype=dtype, max_model_len=1024)
    results = [asyncio.run(_measure(size, args, requests, max_tokens, repeats)) for size in sizes]
    reference = results[0]["tokens"]
    base = results[0]["output_tok_per_s_median"]
    for result in results:
        result["same_tokens"] = result.pop("tokens") == reference
        result["ratio_vs_dp1"] = result["output_tok_per_s_median"] / base
    return {
        "benchmark": "scaleout_dp",
        "model": model or "default (SmolLM2-135M-Instruct GGUF)",
        "dtype": dtype,
        "requests": requests,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "threads_per_engine": int(os.environ["OMP_NUM_THREADS"]),
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    ns = parser.parse_args()
    result = run_dp(
        ns.sizes,
        model=ns.model,
        dtype=ns.dtype,
        requests=ns.requests,
        max_tokens=ns.max_tokens,
        repeats=ns.repeats,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
