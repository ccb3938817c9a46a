"""Two `paged serve` processes on one Redis: engine B's time to first token on engine A's prompt.

    python benchmarks/redis_two_servers.py [--prompt-len 2048] [--reps 3] [--threads 1]

Starts a private redis-server and two `paged serve` engines of the default model
whose only offloading tier is `{"type": "redis"}` (connectors_bench.py's config).
For each of `--reps` rounds, over HTTP (streamed completions of prompt token ids,
one output token):

- `a_computed`: engine A computes a fresh prompt (its chunks go to Redis);
- `b_from_redis`: engine B, which never saw it, answers the same prompt;
- `b_computed`: engine B computes another fresh prompt (recompute, same engine).

Prints one JSON line: median TTFTs, B's cached tokens, whether B's greedy token
equals A's, the speed-up of `b_from_redis` over `b_computed`, load and threads.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def _ttft(url: str, prompt: list[int]) -> tuple[float, int, str]:
    """(seconds to the first streamed token, cached prompt tokens, the token's text)."""
    body = {
        "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    first: float | None = None
    text, cached = "", 0
    with (
        httpx.Client(timeout=600) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as resp,
    ):
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and first is None:
                first = time.perf_counter() - start
            for choice in event.get("choices", []):
                text += choice.get("text") or ""
            usage = event.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or cached)
    if first is None:
        raise RuntimeError("no token was streamed")
    return first, cached, text


def main() -> None:
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # run as a script: benchmarks/ is on sys.path, the repo root not
        sys.path.insert(0, root)
    import redis

    from benchmarks.connectors_bench import _prompts, _redis_config, _wait_for_keys
    from benchmarks.serve_bench import start_server
    from paged.connectors.kv.offloading.redis_server import RedisServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each engine")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    load_before = os.getloadavg()
    server = RedisServer().start()
    engines: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        config = json.dumps(_redis_config(server.url))
        serve_args = ["--max-model-len", str(args.prompt_len + 64), "--kv-transfer-config", config]
        engines = [start_server(serve_args) for _ in range(2)]
        (_, url_a), (_, url_b) = engines
        for url in (url_a, url_b):
            _ttft(url, _prompts(1, 64, seed=99)[0])  # warm-up (short: no chunk written)
        client = redis.Redis.from_url(server.url)
        chunks = args.prompt_len // 256
        stored = len(client.keys("paged:kv:*"))
        times: dict[str, list[float]] = {"a_computed": [], "b_from_redis": [], "b_computed": []}
        cached_b: list[int] = []
        same_token: list[bool] = []
        prompts = _prompts(args.reps, args.prompt_len, seed=11)
        fresh = _prompts(args.reps, args.prompt_len, seed=12)
        for p, q in zip(prompts, fresh, strict=True):
            t, _, token_a = _ttft(url_a, p)
            times["a_computed"].append(t)
            stored += chunks
            _wait_for_keys(client, stored)  # A's writer thread sends them in the background
            t, cached, token_b = _ttft(url_b, p)
            times["b_from_redis"].append(t)
            cached_b.append(cached)
            same_token.append(token_a == token_b)
            t, _, _ = _ttft(url_b, q)
            times["b_computed"].append(t)
            stored += chunks
            _wait_for_keys(client, stored)
    finally:
        for proc, _ in engines:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.stop()
    medians = {k: round(statistics.median(v), 4) for k, v in times.items()}
    result: dict[str, Any] = {
        "bench": "redis_two_servers",
        "prompt_len": args.prompt_len,
        "reps": args.reps,
        "omp_num_threads": args.threads,
        "cpus": len(os.sched_getaffinity(0)),
        "ttft_s": medians,
        "cached_tokens_b": cached_b,
        "same_first_token": same_token,
        "speedup_b_from_redis_vs_b_computed": round(
            medians["b_computed"] / medians["b_from_redis"], 1
        ),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
