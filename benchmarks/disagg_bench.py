"""P/D disaggregation vs one colocated instance: 32 concurrent streams, same machine.

    .venvs/all/bin/python benchmarks/disagg_bench.py [--reps 1] [--threads 1] [--model DIR]

Without --model it builds a random llama (8 layers, hidden 512, 1,024-word
vocab; big enough that a 1,024-token prefill costs far more than a decode
step) in a temp dir. Workload, per run: `--num-short` streams with short
prompts start together and decode `--max-tokens` tokens; while they decode,
`--num-long` streams with `--long-len`-token prompts arrive one every
`--long-gap-s`. Every stream is greedy, `ignore_eos`, streamed.

Modes:
  colocated  one `paged serve`
  disagg     prefill `paged serve` (PagedZmqConnector kv_producer) + decode
             `paged serve` (kv_consumer) + `paged proxy`
Each disagg engine runs torch on `--threads` threads (OMP_NUM_THREADS), the
colocated one on twice that (`--colocated-threads`), so both modes use the
same number of compute threads on the machine.

Reported per mode (median over `--reps`): TTFT p50/p99, inter-token latency
p50/p99 over all streams and over the short streams only (the ones a long
prompt's prefill would stall), output tok/s, and for disagg the KV bytes
moved per request, transfer seconds per request and per 1,000 prompt tokens
(from the decode instance's paged:kv_transfer_* counters: a pull's time runs
from the decoder asking to the bytes being in its memory, so it includes
waiting for the prefill to register the hold). Load average and
thread counts are recorded beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class Stream:
    kind: str  # "short" or "long"
    prompt_len: int
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    tokens: int = 0


def build_model(path: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    config = AutoConfig.for_model(
        "llama",
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    auto: Any = AutoModelForCausalLM
    auto.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1024)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast: Any = PreTrainedTokenizerFast
    fast(tokenizer_object=tk, bos_token="w1", eos_token="w2").save_pretrained(str(path))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def paged_cmd() -> list[str]:
    script = Path(sys.executable).with_name("paged")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "paged.server.cli"]


def start(args: list[str], threads: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(
        [*paged_cmd(), *args, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def one(client: httpx.AsyncClient, url: str, model: str, s: Stream, prompt: list[int],
              max_tokens: int, delay: float) -> None:  # fmt: skip
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    start_t = time.perf_counter()
    last: float | None = None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                if not choice.get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    s.ttft = now - start_t
                else:
                    s.itls.append(now - last)
                last = now
                s.tokens += 1


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


async def workload(url: str, model: str, ns: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    streams: list[Stream] = []
    tasks = []
    limits = httpx.Limits(max_connections=ns.num_short + ns.num_long + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        for i in range(ns.num_short + ns.num_long):
            kind = "short" if i < ns.num_short else "long"
            n = ns.short_len if kind == "short" else ns.long_len
            prompt = [rng.randint(3, 1023) for _ in range(n)]
            delay = 0.0 if kind == "short" else ns.long_start_s + (i - ns.num_short) * ns.long_gap_s
            s = Stream(kind, n)
            streams.append(s)
            tasks.append(one(client, url, model, s, prompt, ns.max_tokens, delay))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    itl_all = [x for s in streams for x in s.itls]
    itl_short = [x for s in streams if s.kind == "short" for x in s.itls]
    ttfts = [s.ttft for s in streams]
    return {
        "ttft_p50_s": pct(ttfts, 50),
        "ttft_p99_s": pct(ttfts, 99),
        "itl_p50_s": pct(itl_all, 50),
        "itl_p99_s": pct(itl_all, 99),
        "short_itl_p50_s": pct(itl_short, 50),
        "short_itl_p99_s": pct(itl_short, 99),
        "short_itl_max_s": max(itl_short) if itl_short else float("nan"),
        "output_tok_s": sum(s.tokens for s in streams) / wall,
        "wall_s": wall,
        "all_completed": all(s.tokens == ns.max_tokens for s in streams),
        "prompt_tokens": sum(s.prompt_len for s in streams),
        "requests": len(streams),
    }


def counter(url: str, name: str, direction: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'direction="{direction}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def warm_up(url: str, model: str) -> None:
    """First-call costs (and the first handshake) out of the figures."""
    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, url, model, Stream("warm-up", 40), [5] * 40, 2, 0.0)


def run_mode(mode: str, model: str, ns: argparse.Namespace, rep: int) -> dict[str, Any]:
    base = ["serve", model, "--device", "cpu", "--block-size", "16", "--max-model-len", "2048"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        threads = ns.threads
        if mode == "colocated":
            # The same torch threads in all as the two disagg engines together.
            threads = ns.colocated_threads or 2 * ns.threads
            proc, url = start(base, threads)
            procs.append(proc)
            decode_url = None
        else:
            side = free_port()

            def cfg(role: str, port: int) -> str:
                extra = {"side_channel_host": "127.0.0.1", "side_channel_port": port}
                return json.dumps({"kv_connector": "PagedZmqConnector", "kv_role": role,
                                   "kv_connector_extra_config": extra})  # fmt: skip

            p, p_url = start([*base, "--kv-transfer-config", cfg("kv_producer", side)], ns.threads)
            procs.append(p)
            d, decode_url = start(
                [*base, "--kv-transfer-config", cfg("kv_consumer", free_port())], ns.threads
            )
            procs.append(d)
            x, url = start(["proxy", "--prefill", p_url, "--decode", decode_url], 1)
            procs.append(x)
        asyncio.run(warm_up(url, model))
        load_before = [round(v, 2) for v in os.getloadavg()]
        before = {}
        if decode_url is not None:
            before = {k: counter(decode_url, f"paged:kv_transfer_{k}_total", "recv")
                      for k in ("bytes", "seconds", "transfers")}  # fmt: skip
        result = asyncio.run(workload(url, model, ns, seed=rep))
        result["torch_threads"] = threads if mode == "colocated" else [ns.threads, ns.threads]
        result["load_avg_before"] = load_before
        result["load_avg_after"] = [round(v, 2) for v in os.getloadavg()]
        if decode_url is not None:
            moved = {k: counter(decode_url, f"paged:kv_transfer_{k}_total", "recv") - before[k]
                     for k in before}  # fmt: skip
            n = moved["transfers"] or 1
            result["kv_transfers"] = moved["transfers"]
            result["kv_bytes_per_request"] = moved["bytes"] / n
            result["transfer_s_per_request"] = moved["seconds"] / n
            result["transfer_s_per_1000_prompt_tokens"] = (
                1000 * moved["seconds"] / result["prompt_tokens"]
            )
        return result
    finally:
        for proc in reversed(procs):
            stop(proc)


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in runs[0]:
        vals = [r[key] for r in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = round(statistics.median(vals), 5)
        else:
            out[key] = vals if len(vals) > 1 else vals[0]
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="a model directory (default: build a random llama)")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per disagg engine")
    p.add_argument(
        "--colocated-threads", type=int, default=0, help="torch threads (default 2 x --threads)"
    )
    p.add_argument("--num-short", type=int, default=24)
    p.add_argument("--num-long", type=int, default=8)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--long-start-s", type=float, default=1.0)
    p.add_argument("--long-gap-s", type=float, default=0.5)
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model or str(build_model(Path(tmp) / "model"))
        runs: dict[str, list[dict[str, Any]]] = {"colocated": [], "disagg": []}
        for rep in range(ns.reps):
            # alternate the order so neither mode always runs first
            order = ["colocated", "disagg"] if rep % 2 == 0 else ["disagg", "colocated"]
            for mode in order:
                runs[mode].append(run_mode(mode, model, ns, rep))
    co, dis = median_of(runs["colocated"]), median_of(runs["disagg"])

    def ratio(key: str) -> float | None:
        a, b = dis.get(key), co.get(key)
        return round(a / b, 3) if isinstance(a, float) and isinstance(b, float) and b else None

    keys = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "short_itl_p99_s",
            "short_itl_max_s", "output_tok_s")  # fmt: skip
    print(json.dumps({
        "benchmark": "disagg",
        "workload": {k: getattr(ns, k) for k in ("num_short", "num_long", "short_len", "long_len",
                                                 "max_tokens", "long_start_s", "long_gap_s")},
        "reps": ns.reps,
        "engine_processes": {"colocated": 1, "disagg": 2},
        "cpu_count": os.cpu_count(),
        "colocated": co,
        "disagg": dis,
        "disagg_over_colocated": {k: ratio(k) for k in keys},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
