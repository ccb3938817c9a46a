"""Event-loop lag while a huge prompt is tokenized: on the loop vs `BlockingWork`.

    python benchmarks/tokenize_lag_bench.py [--mb 5] [--runs 3] [--tokenizer PATH]

A ticker task sleeps 5 ms at a time and records how late each wake-up is;
meanwhile one `--mb` MB prompt is tokenized, first inline (what the API did
before), then through `paged.server.offload.BlockingWork` (a worker thread;
HF fast tokenizers release the GIL while encoding). Prints one JSON line with
the median over `--runs` of the tokenization time and of the worst loop lag.
Default tokenizer: the default model's (SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

from paged.server.offload import BlockingWork
from paged.server.tokenizer import default_model_path, load_tokenizer

_TICK_S = 0.005


async def _ticker(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(_TICK_S)
        lags.append(time.perf_counter() - t0 - _TICK_S)


async def _one(tok: Any, text: str, offload: BlockingWork | None) -> tuple[float, float]:
    stop, lags = asyncio.Event(), [0.0]
    ticker = asyncio.create_task(_ticker(stop, lags))
    await asyncio.sleep(0.05)  # the ticker is running
    t0 = time.perf_counter()
    if offload is None:
        tok.encode(text)
    else:
        await offload.run(len(text), tok.encode, text)
    elapsed = time.perf_counter() - t0
    stop.set()
    await ticker
    return elapsed, max(lags)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=5.0, help="prompt size in MB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokenizer", default=None, help="HF directory or .gguf")
    args = parser.parse_args()
    tok = load_tokenizer(args.tokenizer or str(default_model_path()))
    words = "The quick brown fox jumps over the lazy dog. "
    text = words * int(args.mb * 1e6 / len(words))
    offload = BlockingWork()
    result: dict[str, Any] = {"prompt_bytes": len(text.encode()), "runs": args.runs}
    for name, pool in (("inline", None), ("offloaded", offload)):
        runs = [await _one(tok, text, pool) for _ in range(args.runs)]
        result[f"{name}_tokenize_s"] = round(statistics.median(r[0] for r in runs), 3)
        result[f"{name}_max_loop_lag_s"] = round(statistics.median(r[1] for r in runs), 4)
    offload.shutdown()
    result["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
