"""Pipeline parallelism: output tok/s at PP=2 against PP=1 on the default model.

Two offline engines (`EngineCore`: PP=1 with the in-process executor, PP=2
with one worker process per stage over gloo) generate greedily (`ignore_eos`)
for `--streams` requests of the same `--prompt-len`-token prompt family, all
added at once. Output tok/s = generated tokens / wall time from the first
add to the last output (prefill included). Rounds alternate between the
engines so load drift hits both; medians over `--runs` rounds with min/max,
the PP2/PP1 ratio, whether both produced identical tokens, the torch thread
count of each process and the load average before and after.

On a 2-core machine PP=2 cannot beat PP=1 by much: both stages share the same
cores (each worker gets cpu_count // world threads), and every micro-batch
pays a gloo transfer of [2, T, H] activations. What PP buys is memory (each
stage holds half the layers and its half of the KV cache; the block count
per stage budget is printed) and, on real multi-device hosts, throughput from
overlapping stages.

Run: .venvs/all/bin/python benchmarks/pp_bench.py [--tokens 32 --streams 8 --runs 3 --dtype ...]
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

from paged.runner.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerLimits,
)
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.core import EngineCore


def make_engine(model: ModelConfig, pp: int, streams: int) -> EngineCore:
    config = EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=16, kv_cache_memory_bytes=256 << 20),
        parallel_config=ParallelConfig(pipeline_parallel_size=pp),
        scheduler_limits=SchedulerLimits(max_num_seqs=streams, max_num_batched_tokens=2048),
    )
    return EngineCore(config)


def one_round(
    core: EngineCore, prompts: list[list[int]], tokens: int, tag: str
) -> tuple[float, dict[str, list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", prompt, params, None, 0.0))
    while core.has_work():
        for outs in core.run_step().values():
            for o in outs.outputs:
                out.setdefault(o.request_id.split("-", 1)[1], []).extend(o.new_token_ids)
    elapsed = time.perf_counter() - start
    return sum(len(t) for t in out.values()) / elapsed, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--dtype", default="auto", help="auto: the default model's (int4 GGUF + bf16 on CPU)"
    )
    args = parser.parse_args()

    model = ModelConfig.from_pretrained(None, max_model_len=1024, dtype=args.dtype)
    vocab = model.vocab_size
    # Distinct prompts (no prefix-cache hits between streams): token ids spread over the vocab.
    prompts = [
        [1 + (97 * (s + 1) * (j + 3)) % (vocab - 1) for j in range(args.prompt_len)]
        for s in range(args.streams)
    ]
    load_before = os.getloadavg()
    engines = {pp: make_engine(model, pp, args.streams) for pp in (1, 2)}
    rates: dict[int, list[float]] = {1: [], 2: []}
    outputs: dict[int, dict[str, list[int]]] = {}
    try:
        for r in range(args.runs):
            for pp in (1, 2) if r % 2 == 0 else (2, 1):
                rate, outputs[pp] = one_round(engines[pp], prompts, args.tokens, f"r{r}p{pp}")
                rates[pp].append(rate)
        blocks = {pp: engines[pp].kv_cache_config.num_blocks for pp in (1, 2)}
    finally:
        for core in engines.values():
            core.shutdown()
    load_after = os.getloadavg()
    med = {pp: statistics.median(v) for pp, v in rates.items()}
    cores = os.cpu_count() or 1
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (default)",
        "dtype": str(model.dtype).removeprefix("torch."),
        "quantization": model.quantization,
        "streams": args.streams,
        "prompt_len": args.prompt_len,
        "tokens": args.tokens,
        "runs": args.runs,
        "pp1_output_tok_s_median": round(med[1], 2),
        "pp2_output_tok_s_median": round(med[2], 2),
        "pp1_min_max": [round(min(rates[1]), 2), round(max(rates[1]), 2)],
        "pp2_min_max": [round(min(rates[2]), 2), round(max(rates[2]), 2)],
        "pp2_over_pp1": round(med[2] / med[1], 3),
        "same_tokens": outputs[1] == outputs[2],
        "kv_blocks_per_256MiB": blocks,
        "threads": {
            "pp1_engine": torch.get_num_threads(),
            "pp2_each_worker": max(1, cores // 2),
            "cpu_count": cores,
        },
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in load_after],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
