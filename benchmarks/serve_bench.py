"""Serving benchmark: N concurrent streaming completions against a live `paged serve`.

    python benchmarks/serve_bench.py                      # starts `paged serve` itself
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 [--api-key KEY]

Every request streams `--max-tokens` tokens (`ignore_eos`, so lengths are
fixed). Prints one JSON line: output throughput (tokens/s over the wall time
of the whole batch), and medians of time to first token (TTFT) and
inter-token latency (ITL, gaps between streamed chunks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class RequestResult:
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    text: str = ""


async def _one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    result = RequestResult()
    start = time.perf_counter()
    last: float | None = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                result.tokens = int(event["usage"]["completion_tokens"])
            for choice in event.get("choices", []):
                if not choice.get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                result.text += choice["text"]
    return result


async def run(
    url: str, api_key: str | None, n: int, prompt: str, max_tokens: int
) -> dict[str, object]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(headers=headers, timeout=3600, limits=limits) as client:
        await _one(client, url, prompt, 2)  # warm-up (first-call costs)
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, prompt, max_tokens) for _ in range(n)))
        duration = time.perf_counter() - start
    tokens = sum(r.tokens for r in results)
    itls = [x for r in results for x in r.itls]
    return {
        "benchmark": "serve",
        "num_requests": n,
        "max_tokens": max_tokens,
        "duration_s": round(duration, 3),
        "output_tokens": tokens,
        "throughput_tok_s": round(tokens / duration, 2),
        "ttft_median_s": round(statistics.median(r.ttft for r in results), 4),
        "itl_median_s": round(statistics.median(itls), 4) if itls else None,
        "all_completed": all(r.tokens == max_tokens for r in results),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    script = Path(sys.executable).with_name("paged")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "paged.server.cli"]
    cmd += ["serve", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"paged serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("paged serve did not start")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="a running server; default: start `paged serve`")
    p.add_argument("--api-key")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="Write a short story about a robot who learns to paint.")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra argument for the started `paged serve` (repeatable)",
    )
    ns = p.parse_args()
    proc = None
    url = ns.url
    if url is None:
        proc, url = start_server(ns.serve_arg)
    try:
        result = asyncio.run(run(url, ns.api_key, ns.num_requests, ns.prompt, ns.max_tokens))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    result["server_args"] = ns.serve_arg
    print(json.dumps(result))


if __name__ == "__main__":
    main()
