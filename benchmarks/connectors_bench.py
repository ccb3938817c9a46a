"""OffloadingConnector on the default model (SmolLM2-135M GGUF): TTFT per tier, decode cost.

Time to first token (`generate(max_tokens=1)`, offline `LLM`) of `--prompt-len`
token prompts (`--reps` distinct random prompts, medians):

- `computed`: a prompt never seen (the connector saves its chunks meanwhile);
- `computed_no_connector`: the same on an engine with no connector (what
  saving costs), interleaved with `computed`;
- `device_prefix_cache`: the same prompt again;
- `host_tier`: again after `reset_prefix_cache()` (loaded from host memory);
- `disk_tier`: in a new `LLM` on the same disk directory (the index rebuilt
  from the files; host memory empty), i.e. after a restart.

Two engines on one Redis (`--skip-redis` to leave out; a private
redis-server is started unless `--redis-url` names one): engines A and B,
each with only the Redis tier (`secondary_tiers: [{"type": "redis"}]`). A
computes a prompt and writes its chunks; then on B:

- `redis_tier`: that prompt, loaded from Redis (B never saw it);
- `redis_b_computed`: a prompt nobody saw, computed by B (and written to Redis),
  interleaved with `redis_tier`.

Decode: `--streams` greedy streams of `--decode-prompt-len` prompt tokens
generating `--decode-tokens` each; tokens per second counted from the
moment every stream has its first token (steady-state decode), with the
OffloadingConnector on (host tier, chunks of `--decode-chunk` tokens, so
every prompt saves one chunk) versus no connector, the two engines alternating.

Layer-wise (`--layerwise`, alone: the other phases are skipped): TTFT of
`--prompt-len` token prompts served from the host tier by two engines, one
with `use_layerwise` off (the whole prefix copied before the forward) and one
with it on (copied layer by layer while the forward runs), alternating per
prompt; medians, and whether both engines' first tokens equal the computed ones.

torch runs on `--threads` CPU threads (set before torch is imported).
Run: .venvs/all/bin/python benchmarks/connectors_bench.py [--threads 1]
(the Redis case alone: --skip-ttft --skip-decode)
Prints one JSON line.
"""

from __future__ import annotations

import os
import sys

# torch reads the thread count when imported: set it from --threads first.
os.environ["OMP_NUM_THREADS"] = (
    sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "1"
)

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.sampling_params import SamplingParams
from paged.server.input_processor import TokensPrompt
from paged.server.llm import LLM

VOCAB = 49152  # SmolLM2's


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(length)] for _ in range(n)]


def _offload_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def _llm(args: argparse.Namespace, kv_transfer_config: dict[str, Any] | None, **extra: Any) -> LLM:
    options: dict[str, Any] = {"device": args.device, "max_model_len": args.prompt_len + 64}
    options.update(extra)
    if kv_transfer_config is not None:
        options["kv_transfer_config"] = kv_transfer_config
    return LLM(None, **options)


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    tokens: TokensPrompt = {"prompt_token_ids": prompt}
    start = time.perf_counter()
    (out,) = llm.generate([tokens], params, use_tqdm=False)
    return time.perf_counter() - start, out.num_cached_tokens


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def bench_ttft(args: argparse.Namespace) -> dict[str, Any]:
    prompts = _prompts(args.reps, args.prompt_len, seed=1)
    others = _prompts(args.reps, args.prompt_len, seed=2)
    phases: dict[str, list[float]] = {
        name: []
        for name in ("computed", "computed_no_connector", "device_prefix_cache", "host_tier")
    }
    cached: dict[str, list[int]] = {}

    def timed(phase: str, llm: LLM, prompt: list[int]) -> None:
        t, c = _ttft(llm, prompt)
        phases.setdefault(phase, []).append(t)
        cached.setdefault(phase, []).append(c)

    with tempfile.TemporaryDirectory() as disk:
        cfg = _offload_config({"kv_bytes_per_rank": args.host_gib * (1 << 30), "disk_path": disk})
        baseline = _llm(args, None)
        llm = _llm(args, cfg)
        for engine in (baseline, llm):
            _ttft(engine, _prompts(1, 64, seed=99)[0])  # warm-up
        # Interleaved, so that load from other processes hits both alike.
        for p, q in zip(prompts, others, strict=True):
            timed("computed_no_connector", baseline, q)
            timed("computed", llm, p)
            timed("device_prefix_cache", llm, p)
        baseline.engine_client.shutdown()
        for p in prompts:
            assert llm.reset_prefix_cache()
            timed("host_tier", llm, p)
        llm.engine_client.shutdown()  # flushes the disk writes
        restarted = _llm(args, cfg)
        _ttft(restarted, _prompts(1, 64, seed=98)[0])
        for p in prompts:
            timed("disk_tier", restarted, p)
        restarted.engine_client.shutdown()
        files = len(list(Path(disk).glob("*.kvchunk")))
    out: dict[str, Any] = {f"ttft_{phase}_s": _median(t) for phase, t in phases.items()}
    for phase, counts in cached.items():
        out[f"cached_tokens_{phase}"] = statistics.median(counts)
    out["disk_chunk_files"] = files
    base = out["ttft_computed_s"]
    for phase in ("device_prefix_cache", "host_tier", "disk_tier"):
        out[f"speedup_{phase}_vs_computed"] = round(base / out[f"ttft_{phase}_s"], 1)
    out["computed_with_vs_without_connector"] = round(base / out["ttft_computed_no_connector_s"], 3)
    return out


def _redis_config(url: str) -> dict[str, Any]:
    return _offload_config(
        {
            "spec_name": "TieringOffloadingSpec",
            "block_size": 256,
            "secondary_tiers": [{"type": "redis", "url": url, "read_timeout_s": 5.0}],
        }
    )


def _wait_for_keys(client: Any, n: int) -> None:
    deadline = time.monotonic() + 120
    while len(client.keys("paged:kv:*")) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine A's chunks never reached Redis ({n} keys expected)")
        time.sleep(0.05)


def bench_redis(args: argparse.Namespace) -> dict[str, Any]:
    import redis

    from paged.connectors.kv.offloading.redis_server import RedisServer

    server = None if args.redis_url else RedisServer().start()
    url = args.redis_url or (server.url if server is not None else "")
    try:
        client = redis.Redis.from_url(url)
        client.flushall()
        prompts = _prompts(args.reps, args.prompt_len, seed=3)
        fresh = _prompts(args.reps, args.prompt_len, seed=4)
        a = _llm(args, _redis_config(url))
        b = _llm(args, _redis_config(url))
        for i, engine in enumerate((a, b)):
            _ttft(engine, _prompts(1, 64, seed=97 - i)[0])  # warm-up (short: no chunk)
        chunks = args.prompt_len // 256
        phases: dict[str, list[float]] = {"redis_a_computed": [], "redis_tier": []}
        phases["redis_b_computed"] = []
        cached: dict[str, list[int]] = {name: [] for name in phases}
        stored = 0
        for p, q in zip(prompts, fresh, strict=True):
            for phase, engine, prompt in (
                ("redis_a_computed", a, p),
                ("redis_tier", b, p),
                ("redis_b_computed", b, q),
            ):
                t, c = _ttft(engine, prompt)
                phases[phase].append(t)
                cached[phase].append(c)
                if phase != "redis_tier":
                    stored += chunks
                    _wait_for_keys(client, stored)  # the writes run in the background
        for engine in (a, b):
            engine.engine_client.shutdown()
        value_bytes = sum(client.memory_usage(k) or 0 for k in client.keys("paged:kv:*"))
    finally:
        if server is not None:
            server.stop()
    out: dict[str, Any] = {f"ttft_{phase}_s": _median(t) for phase, t in phases.items()}
    for phase, counts in cached.items():
        out[f"cached_tokens_{phase}"] = statistics.median(counts)
    out["redis_chunks"] = stored
    out["redis_bytes_per_chunk"] = value_bytes // max(stored, 1)
    out["speedup_redis_tier_vs_b_computed"] = round(
        out["ttft_redis_b_computed_s"] / out["ttft_redis_tier_s"], 1
    )
    return out


def _decode_tokens_per_s(llm: LLM, args: argparse.Namespace, seed: int) -> float:
    client: Any = llm.engine_client
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    prompts = _prompts(args.streams, args.decode_prompt_len, seed)
    for i, p in enumerate(prompts):
        client.add_request(EngineCoreRequest(f"d{seed}-{i}", p, params, None, 0.0))
    counts = dict.fromkeys(range(args.streams), 0)
    started: float | None = None
    decoded = 0
    finished = 0
    while finished < args.streams:
        outputs = client.get_output()
        now = time.perf_counter()
        for o in outputs.outputs:
            i = int(o.request_id.rsplit("-", 1)[1])
            counts[i] += len(o.new_token_ids)
            if started is not None:
                decoded += len(o.new_token_ids)
            finished += o.finished
        if started is None and all(counts.values()):
            started = now
    assert started is not None
    return decoded / (time.perf_counter() - started)


def bench_decode(args: argparse.Namespace) -> dict[str, Any]:
    configs = {
        "no_connector": None,
        "offloading": _offload_config(
            {"kv_bytes_per_rank": args.host_gib * (1 << 30), "chunk_size": args.decode_chunk}
        ),
    }
    # Both engines get the same weight layout (panels are "auto" by default, decided by
    # the free memory each engine sees at load: the second engine in a process can get
    # a different layout, which would be measured as the connector's cost).
    engines = {name: _llm(args, cfg, cpu_weight_panels="off") for name, cfg in configs.items()}
    results: dict[str, list[float]] = {name: [] for name in configs}
    names = list(engines)
    for rep in range(args.reps):
        # A B, B A, A B ...: neither engine always runs first (warm caches, load drift).
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            results[name].append(_decode_tokens_per_s(engines[name], args, seed=10 + rep))
    for llm in engines.values():
        llm.engine_client.shutdown()
    out: dict[str, Any] = {
        f"decode_{name}_tokens_per_s": round(statistics.median(v), 1) for name, v in results.items()
    }
    out["decode_offloading_vs_no_connector"] = round(
        out["decode_offloading_tokens_per_s"] / out["decode_no_connector_tokens_per_s"], 3
    )
    return out


def _first_token(llm: LLM, prompt: list[int]) -> tuple[float, int, int]:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    tokens: TokensPrompt = {"prompt_token_ids": prompt}
    start = time.perf_counter()
    (out,) = llm.generate([tokens], params, use_tqdm=False)
    return time.perf_counter() - start, out.num_cached_tokens, out.outputs[0].token_ids[0]


def bench_layerwise(args: argparse.Namespace) -> dict[str, Any]:
    host = {"kv_bytes_per_rank": args.host_gib * (1 << 30)}
    modes = {"sync": False, "layerwise": True}
    # Same weight layout for both engines (see bench_decode).
    engines = {
        mode: _llm(args, _offload_config({**host, "use_layerwise": on}), cpu_weight_panels="off")
        for mode, on in modes.items()
    }
    for llm in engines.values():
        _ttft(llm, _prompts(1, 64, seed=99)[0])  # warm-up
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    cached: dict[str, list[int]] = {mode: [] for mode in modes}
    identical = True
    for rep, prompt in enumerate(_prompts(args.reps, args.prompt_len, seed=3)):
        computed = {mode: _first_token(llm, prompt)[2] for mode, llm in engines.items()}
        order = list(modes) if rep % 2 == 0 else list(modes)[::-1]
        for mode in order:
            llm = engines[mode]
            assert llm.reset_prefix_cache()
            t, c, token = _first_token(llm, prompt)
            times[mode].append(t)
            cached[mode].append(c)
            identical &= token == computed[mode] == computed["sync"]
    for llm in engines.values():
        llm.engine_client.shutdown()
    out: dict[str, Any] = {f"ttft_host_tier_{m}_s": _median(t) for m, t in times.items()}
    out.update({f"ttft_host_tier_{m}_all_s": [round(x, 4) for x in t] for m, t in times.items()})
    out.update({f"cached_tokens_{m}": statistics.median(c) for m, c in cached.items()})
    out["layerwise_vs_sync_speedup"] = round(
        out["ttft_host_tier_sync_s"] / out["ttft_host_tier_layerwise_s"], 3
    )
    out["first_tokens_identical"] = identical
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--host-gib", type=float, default=2.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--decode-prompt-len", type=int, default=80)
    parser.add_argument("--decode-chunk", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-redis", action="store_true")
    parser.add_argument("--redis-url", default="", help="default: a private redis-server")
    parser.add_argument("--layerwise", action="store_true", help="only the layer-wise comparison")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "bench": "connectors",
        "model": "SmolLM2-135M-Instruct (GGUF, default)",
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "reps": args.reps,
        "chunk_size": 256,
        "streams": args.streams,
        "decode_prompt_len": args.decode_prompt_len,
        "decode_tokens": args.decode_tokens,
        "load_avg_before": [round(x, 2) for x in os.getloadavg()],
    }
    if args.layerwise:
        result.update(bench_layerwise(args))
        args.skip_ttft = args.skip_decode = args.skip_redis = True
    if not args.skip_ttft:
        result.update(bench_ttft(args))
    if not args.skip_redis:
        result.update(bench_redis(args))
    if not args.skip_decode:
        result.update(bench_decode(args))
    result["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
