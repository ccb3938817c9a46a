"""LoRA serving cost: output tok/s of N concurrent streams with 0..K distinct adapters in the batch.

    python benchmarks/lora_bench.py                       # the default model, ranks 8 16 64
    python benchmarks/lora_bench.py --model M.gguf --ranks 16 --adapters 0 1 8

For every rank it writes `max(--adapters)` random PEFT adapters of that rank for
the model (all seven target modules, B != 0, so every delta is computed), starts
one `paged serve --enable-lora --lora-modules ...` and streams `--streams`
completions (`ignore_eos`, `--max-tokens` each) whose `model` cycles over the
first k adapters (k = 0: the base model on the LoRA-enabled server). The
baseline is the same load on a server without `--enable-lora`. Runs alternate
between configurations; each figure is the median of `--repeats`. It also
times a request whose adapter must first be loaded from disk (runtime loading,
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`): the load call plus that request's
time to first token, beside the TTFT of a request on a resident adapter.

Prints one JSON object (load average and thread settings included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

PROMPT = "Write a short story about a robot who learns to paint."
TARGETS = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}  # fmt: skip


@dataclass
class RequestResult:
    ttft: float = 0.0
    tokens: int = 0


def model_shapes(gguf_path: str) -> dict[str, int]:
    """hidden, intermediate, layers, q and kv widths read from a GGUF's metadata."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)

    def value(key: str) -> Any:
        field = reader.fields[key]
        return field.parts[field.data[0]].tolist()[0] if field.types else None

    def text(key: str) -> str:
        field = reader.fields[key]
        return bytes(field.parts[field.data[0]]).decode()

    arch = text("general.architecture")
    hidden = int(value(f"{arch}.embedding_length"))
    heads = int(value(f"{arch}.attention.head_count"))
    kv_heads = int(value(f"{arch}.attention.head_count_kv"))
    key_length = f"{arch}.attention.key_length"
    head_dim = int(value(key_length)) if key_length in reader.fields else hidden // heads
    return {
        "hidden": hidden,
        "intermediate": int(value(f"{arch}.feed_forward_length")),
        "layers": int(value(f"{arch}.block_count")),
        "q": heads * head_dim,
        "kv": kv_heads * head_dim,
    }


def write_adapter(directory: Path, shapes: dict[str, int], rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)."""
    h, i = shapes["hidden"], shapes["intermediate"]
    in_out = {
        "q_proj": (h, shapes["q"]), "k_proj": (h, shapes["kv"]), "v_proj": (h, shapes["kv"]),
        "o_proj": (shapes["q"], h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shapes["layers"]):
        for name, part in TARGETS.items():
            fan_in, fan_out = in_out[name]
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            a = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            b = torch.randn(fan_out, rank, generator=gen) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS), "bias": "none", "lora_dropout": 0.0,
    }  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))


async def _stream(
    client: httpx.AsyncClient, url: str, model: str, max_tokens: int
) -> RequestResult:
    body = {
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    result = RequestResult()
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                result.tokens = int(event["usage"]["completion_tokens"])
            if result.ttft == 0.0 and event.get("choices"):
                # The first token's chunk (its text may be empty: part of a character).
                result.ttft = time.perf_counter() - start
    return result


async def throughput(url: str, models: list[str], streams: int, max_tokens: int) -> float:
    """Output tokens per second of `streams` concurrent requests cycling over `models`."""
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        await asyncio.gather(*(_stream(client, url, m, 2) for m in models))  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(
            *(_stream(client, url, models[k % len(models)], max_tokens) for k in range(streams))
        )
        elapsed = time.perf_counter() - start
    return float(sum(r.tokens for r in results) / elapsed)


async def cold_adapter_ttft(url: str, name: str, path: Path, resident: str) -> dict[str, float]:
    """Seconds to load `path` at runtime plus its first request's TTFT, against a resident one."""
    async with httpx.AsyncClient(timeout=600) as client:
        warm = await _stream(client, url, resident, 1)
        start = time.perf_counter()
        resp = await client.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
        )
        if resp.status_code != 200:
            raise RuntimeError(f"load_lora_adapter: HTTP {resp.status_code}: {resp.text[:300]}")
        loaded = time.perf_counter() - start
        cold = await _stream(client, url, name, 1)
        await client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
    return {"load_s": loaded, "first_ttft_s": cold.ttft, "resident_ttft_s": warm.ttft}


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="a GGUF file; default: the default model")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 8])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `paged serve` argument")
    ns = p.parse_args()
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # run as a script: benchmarks/ is on sys.path, the repo root not
        sys.path.insert(0, root)
    from benchmarks.serve_bench import start_server

    if ns.model is None:
        from paged.runner.default_model import default_model_path

        ns.model = str(default_model_path())
    shapes = model_shapes(ns.model)
    most = max(ns.adapters)
    load_before = os.getloadavg()
    report: dict[str, Any] = {
        "model": ns.model, "shapes": shapes, "streams": ns.streams, "max_tokens": ns.max_tokens,
        "repeats": ns.repeats, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpus": len(os.sched_getaffinity(0)), "serve_args": ns.serve_arg,
    }  # fmt: skip
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        servers: dict[str, tuple[subprocess.Popen[bytes], str, list[list[str]]]] = {}
        try:
            proc, url = start_server(["--model", ns.model, *ns.serve_arg])
            servers["base"] = (proc, url, [[]])
            for rank in ns.ranks:
                modules = []
                for k in range(most + 1):  # the extra one is loaded at runtime
                    write_adapter(Path(tmp) / f"r{rank}-{k}", shapes, rank, seed=1000 * rank + k)
                    if k < most:
                        modules.append(f"r{rank}-{k}={Path(tmp) / f'r{rank}-{k}'}")
                args = [
                    "--model", ns.model, "--enable-lora", "--max-loras", str(max(most, 1)),
                    "--max-lora-rank", str(rank), "--lora-modules", *modules, *ns.serve_arg,
                ]  # fmt: skip
                proc, url = start_server(args)
                mixes = [[f"r{rank}-{k}" for k in range(n)] for n in ns.adapters]
                servers[f"rank{rank}"] = (proc, url, mixes)
            samples: dict[str, list[float]] = {}
            for _ in range(ns.repeats):  # alternate every configuration within each repeat
                for key, (_, url, mixes) in servers.items():
                    for models in mixes:
                        label = "no-lora" if key == "base" else f"{key}/{len(models)}-adapters"
                        served = models or [_served_name(url)]  # none: the base model
                        tok_s = asyncio.run(throughput(url, served, ns.streams, ns.max_tokens))
                        samples.setdefault(label, []).append(tok_s)
            baseline = statistics.median(samples["no-lora"])
            report["tok_s"] = {k: round(statistics.median(v), 1) for k, v in samples.items()}
            report["vs_no_lora"] = {
                k: round(statistics.median(v) / baseline, 3) for k, v in samples.items()
            }
            report["cold_adapter"] = {}
            for rank in ns.ranks:
                _, url, _ = servers[f"rank{rank}"]
                report["cold_adapter"][f"rank{rank}"] = asyncio.run(
                    cold_adapter_ttft(url, f"r{rank}-{most}", Path(tmp) / f"r{rank}-{most}",
                                      resident=f"r{rank}-0" if most else _served_name(url))
                )  # fmt: skip
        finally:
            for proc, _, _ in servers.values():
                stop(proc)
    report["loadavg_before"] = load_before
    report["loadavg_after"] = os.getloadavg()
    print(json.dumps(report))


def _served_name(url: str) -> str:
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return str(next(m["id"] for m in data if m.get("parent") in (None, m["id"])))


if __name__ == "__main__":
    main()
