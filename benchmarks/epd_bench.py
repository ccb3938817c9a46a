"""EPD (encoder producer + consumer + proxy) vs one colocated instance, same machine.

    .venvs/all/bin/python benchmarks/epd_bench.py [--reps 1] [--threads 1] [--chats 16]

A random Gemma3ForConditionalGeneration is built in a temp dir (offline
processor of paged.server.mm_testing; SigLIP `--vision-layers` x
`--vision-hidden` on `--image-size` images with 14-pixel patches, pooled to
`--mm-tokens` soft tokens; a `--text-layers` text model), so the vision
encoder is a real share of a prefill. Workload per run: `--chats` streamed
chats start together, each with `--images` distinct random PNGs and a short
question, greedy, `--max-tokens` tokens, `ignore_eos`.

Modes:
  colocated  one `paged serve`
  epd        `paged serve --ec-role producer` (encode only) + `paged serve
             --ec-role consumer` + `paged proxy --encode P --decode C`
Each EPD engine runs torch on `--threads` threads, the colocated one on twice
that (`--colocated-threads`), so both modes use the same compute threads; on a
machine loaded beyond its cores, 2 OpenMP threads in one process can be far
slower than 1 (threads wait for each other while descheduled), so compare with
`--colocated-threads 1` too.

Reported per mode (median over `--reps`): TTFT p50/p99, output tok/s, and
from the engines' /metrics: images through each engine's vision encoder
(`paged:mm_encoder_items_computed_total`) and loaded through the EC connector
(`paged:ec_connector_loaded_items_total`), the producer's mean request time
(its `e2e_request_latency`: the encode stage as the proxy sees it, queueing
included). Encoder seconds on each side = images encoded there x the
per-image cost of the same vision tower measured in this process on
`--threads` threads (a batch of `--images` images), so the figure is
derived, not read from the engines. Bytes moved per image = the wire payload
of one output, `mm_tokens x text hidden x 4` (float32 rows) plus its msgpack
header (measured once by encoding one). Load average and thread counts are
recorded beside the figures.
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
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


def build_model(path: Path, ns: argparse.Namespace) -> Path:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from paged.server.mm_testing import save_tiny_gemma3_processor

    processor = save_tiny_gemma3_processor(
        path, image_size=ns.image_size, mm_tokens_per_image=ns.mm_tokens
    )
    tok = processor.tokenizer
    hidden = ns.text_hidden
    text = {
        "vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": ns.text_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": hidden // 4, "max_position_embeddings": 2048,
        "sliding_window": 64, "query_pre_attn_scalar": hidden // 4,
        "layer_types": ["sliding_attention", "full_attention"] * (ns.text_layers // 2)
        + ["sliding_attention"] * (ns.text_layers % 2),
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }  # fmt: skip
    vision = {
        "hidden_size": ns.vision_hidden, "intermediate_size": 4 * ns.vision_hidden,
        "num_hidden_layers": ns.vision_layers, "num_attention_heads": 4,
        "image_size": ns.image_size, "patch_size": 14, "vision_use_head": False,
    }  # fmt: skip
    config_cls: Any = Gemma3Config
    config = config_cls(
        text_config=text, vision_config=vision, mm_tokens_per_image=ns.mm_tokens,
        image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
        boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model: Any = Gemma3ForConditionalGeneration(config)
    model.to(torch.float32).eval().save_pretrained(str(path))
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
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[:2]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{args[:2]} did not start")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metric(url: str, name: str) -> float:
    """Sum of a metric's samples on one engine (0 when absent)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Chat:
    seeds: list[int]
    ttft: float = 0.0
    tokens: int = 0


def chat_body(model: str, seeds: list[int], max_tokens: int) -> dict[str, Any]:
    from paged.server.mm_testing import png_data_url

    content: list[dict[str, Any]] = [{"type": "text", "text": "compare the images please"}]
    content += [{"type": "image_url", "image_url": {"url": png_data_url(s)}} for s in seeds]
    return {
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "logprobs": True,
    }  # fmt: skip


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any], c: Chat) -> None:
    start_t = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                # Count tokens by their logprobs entries: a token may decode to "" (a
                # partial UTF-8 byte), which a count of non-empty deltas would miss.
                n = len((choice.get("logprobs") or {}).get("content") or [])
                if n and not c.tokens:
                    c.ttft = time.perf_counter() - start_t
                c.tokens += n


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


async def workload(url: str, model: str, ns: argparse.Namespace, rep: int) -> dict[str, Any]:
    # Distinct images in every chat and every rep: no encoder-cache hit anywhere.
    base = 10_000 * (rep + 1)
    chats = [Chat([base + ns.images * i + k for k in range(ns.images)]) for i in range(ns.chats)]
    bodies = [chat_body(model, c.seeds, ns.max_tokens) for c in chats]
    limits = httpx.Limits(max_connections=ns.chats + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, url, b, c) for b, c in zip(bodies, chats, strict=True)))
        wall = time.perf_counter() - t0
    ttfts = [c.ttft for c in chats]
    return {
        "ttft_p50_s": pct(ttfts, 50),
        "ttft_p99_s": pct(ttfts, 99),
        "output_tok_s": sum(c.tokens for c in chats) / wall,
        "all_completed": all(c.tokens == ns.max_tokens for c in chats),
        "wall_s": wall,
        "chats": ns.chats,
        "images": ns.chats * ns.images,
    }


async def warm_up(url: str, model: str) -> None:
    async with httpx.AsyncClient(timeout=900) as client:
        await one(client, url, chat_body(model, [1], 2), Chat([1]))


def per_image_encoder_s(model: str, ns: argparse.Namespace) -> float:
    """Median seconds per image of the vision tower alone, batches of --images, here."""
    import numpy as np
    import torch

    from paged.runner.config import ModelConfig
    from paged.runner.encode_only import load_vision_encoder

    torch.set_num_threads(ns.threads)
    encoder = load_vision_encoder(ModelConfig.from_pretrained(model), torch.device("cpu"))
    rng = np.random.default_rng(0)
    size = ns.image_size
    items = [
        {"pixel_values": torch.from_numpy(rng.standard_normal((3, size, size), dtype=np.float32))}
        for _ in range(ns.images)
    ]
    times = []
    with torch.inference_mode():
        for _ in range(5):
            t0 = time.perf_counter()
            encoder.embed_multimodal("image", items)
            times.append((time.perf_counter() - t0) / ns.images)
    return float(statistics.median(times))


def wire_bytes_per_image(ns: argparse.Namespace) -> int:
    from paged.connectors.ec.p2p import wire

    header = wire.EmbeddingHeader(1, "x" * 64, [ns.mm_tokens, ns.text_hidden], "float32")
    return int(len(wire.ENCODER.encode(header)) + ns.mm_tokens * ns.text_hidden * 4)


def run_mode(mode: str, model: str, ns: argparse.Namespace, rep: int) -> dict[str, Any]:
    base = ["serve", model, "--max-model-len", "1024", "--kv-cache-memory", "256MiB",
            "--limit-mm-per-prompt", json.dumps({"image": ns.images})]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if mode == "colocated":
            threads: Any = ns.colocated_threads or 2 * ns.threads
            proc, url = start(base, threads)
            procs.append(proc)
            engines = {"colocated": url}
        else:
            threads = [ns.threads, ns.threads]
            zmq = free_port()
            p, p_url = start([*base, "--ec-role", "producer", "--ec-connector-extra-config",
                              json.dumps({"listen_port": zmq})], ns.threads)  # fmt: skip
            procs.append(p)
            # vLLM 0.33's way: the consumer is told no producer; the proxy forwards
            # the producer's ec_transfer_params (where each image is held).
            c, c_url = start([*base, "--ec-role", "consumer"], ns.threads)
            procs.append(c)
            x, url = start(["proxy", "--encode", p_url, "--decode", c_url], 1)
            procs.append(x)
            engines = {"producer": p_url, "consumer": c_url}
        asyncio.run(warm_up(url, model))
        names = ("paged:mm_encoder_items_computed_total", "paged:ec_connector_loaded_items_total",
                 "paged:e2e_request_latency_seconds_sum",
                 "paged:e2e_request_latency_seconds_count")  # fmt: skip
        before = {(e, n): metric(u, n) for e, u in engines.items() for n in names}
        load_before = [round(v, 2) for v in os.getloadavg()]
        result = asyncio.run(workload(url, model, ns, rep))
        result["load_avg_before"] = load_before
        result["load_avg_after"] = [round(v, 2) for v in os.getloadavg()]
        result["torch_threads"] = threads
        delta = {(e, n): metric(u, n) - before[(e, n)] for e, u in engines.items() for n in names}
        for e in engines:
            result[f"{e}_images_encoded"] = delta[(e, names[0])]
            result[f"{e}_images_loaded"] = delta[(e, names[1])]
        if "producer" in engines:
            n = delta[("producer", names[3])] or 1
            result["producer_mean_request_s"] = delta[("producer", names[2])] / n
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
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per EPD engine")
    p.add_argument(
        "--colocated-threads", type=int, default=0, help="torch threads (default 2 x --threads)"
    )
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--images", type=int, default=4, help="images per chat")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--mm-tokens", type=int, default=64, help="soft tokens per image")
    p.add_argument("--vision-layers", type=int, default=4)
    p.add_argument("--vision-hidden", type=int, default=256)
    p.add_argument("--text-layers", type=int, default=4)
    p.add_argument("--text-hidden", type=int, default=256)
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "model", ns))
        per_image = per_image_encoder_s(model, ns)
        runs: dict[str, list[dict[str, Any]]] = {"colocated": [], "epd": []}
        for rep in range(ns.reps):
            order = ["colocated", "epd"] if rep % 2 == 0 else ["epd", "colocated"]
            for mode in order:
                runs[mode].append(run_mode(mode, model, ns, rep))
    co, epd = median_of(runs["colocated"]), median_of(runs["epd"])
    co["encoder_s_derived"] = round(co["colocated_images_encoded"] * per_image, 4)
    epd["producer_encoder_s_derived"] = round(epd["producer_images_encoded"] * per_image, 4)
    epd["consumer_encoder_s_derived"] = round(epd["consumer_images_encoded"] * per_image, 4)

    def ratio(key: str) -> float | None:
        a, b = epd.get(key), co.get(key)
        return round(a / b, 3) if isinstance(a, float) and isinstance(b, float) and b else None

    print(json.dumps({
        "benchmark": "epd",
        "workload": {k: getattr(ns, k) for k in ("chats", "images", "max_tokens", "image_size",
                                                 "mm_tokens", "vision_layers", "vision_hidden",
                                                 "text_layers", "text_hidden")},
        "reps": ns.reps,
        "engine_processes": {"colocated": 1, "epd": 2},
        "cpu_count": os.cpu_count(),
        "per_image_encoder_s": round(per_image, 5),
        "wire_bytes_per_image": wire_bytes_per_image(ns),
        "colocated": co,
        "epd": epd,
        "epd_over_colocated": {k: ratio(k) for k in ("ttft_p50_s", "ttft_p99_s", "output_tok_s")},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
