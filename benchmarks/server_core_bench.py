"""Engine-core IPC benchmark: msgpack framing cost and multiprocess token throughput.

A scripted core (no model) emits one token per request per step, so the
numbers measure the engine loop, the ZMQ sockets and msgpack, not a model:

- `serial_us_per_batch`: encode + decode of one EngineCoreOutputs of 64 outputs.
- `inproc_tokens_per_s`: tokens through InprocClient (no IPC), same core.
- `mp_tokens_per_s`: tokens through SyncMPClient (engine in its own process).

With `--model`, the real EngineCore on a tiny random Llama checkpoint (built
in a temporary directory; CPU, float32) generates `--tokens` greedy tokens
for each of `--requests` prompts, in-process (`llama_inproc_*`), in-process
with the batch queue (`llama_batch_queue_*`) and behind SyncMPClient
(`llama_mp_*`): the IPC overhead next to a (small) model's compute.

torch runs on one CPU thread (set before torch is imported, inherited by the
engine process): on a shared machine, OpenMP threads spinning against other
load make step times vary by 100x.

Run: .venv/bin/python benchmarks/server_core_bench.py [--requests 64 --tokens 64] [--model]
Prints one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from paged.scheduler.boundary import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.client import InprocClient, SyncMPClient
from paged.server.engine.messages import EngineCoreInfo
from paged.server.engine.serial import MsgpackDecoder, MsgpackEncoder


class ScriptedCore:
    """One token per running request per step; finishes at max_tokens."""

    def __init__(self) -> None:
        self._left: dict[str, int] = {}

    @property
    def info(self) -> EngineCoreInfo:
        return EngineCoreInfo(0, 16, 4096, 0)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._left[request.request_id] = request.sampling_params.max_tokens or 1

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._left.pop(rid, None)

    def has_work(self) -> bool:
        return bool(self._left)

    def run_step(self) -> dict[int, EngineCoreOutputs]:
        outs = []
        for rid, left in list(self._left.items()):
            done = left == 1
            outs.append(
                EngineCoreOutput(rid, [left], finish_reason=FinishReason.LENGTH if done else None)
            )
            if done:
                del self._left[rid]
            else:
                self._left[rid] = left - 1
        stats = SchedulerStats(num_running_reqs=len(self._left))
        return {0: EngineCoreOutputs(outputs=outs, scheduler_stats=stats, timestamp=time.time())}

    def call_utility(self, method: str, args: Sequence[Any]) -> object:
        raise ValueError(method)

    def shutdown(self) -> None:
        pass


def _requests(n: int, tokens: int) -> list[EngineCoreRequest]:
    params = SamplingParams(max_tokens=tokens)
    return [EngineCoreRequest(f"r{i}", [1, 2, 3], params, None, 0.0) for i in range(n)]


def bench_serial(iters: int = 2000) -> float:
    batch = EngineCoreOutputs(
        outputs=[EngineCoreOutput(f"req-{i}", [i]) for i in range(64)],
        scheduler_stats=SchedulerStats(num_running_reqs=64),
        timestamp=1.0,
    )
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    start = time.perf_counter()
    for _ in range(iters):
        dec.decode(enc.encode(batch))
    return (time.perf_counter() - start) / iters * 1e6


def drain(get: Any, n: int) -> int:
    finished = tokens = 0
    while finished < n:
        for out in get().outputs:
            tokens += len(out.new_token_ids)
            finished += out.finished
    return tokens


def bench_inproc(n: int, tokens: int) -> float:
    client = InprocClient(ScriptedCore())
    start = time.perf_counter()
    for r in _requests(n, tokens):
        client.add_request(r)
    total = drain(client.get_output, n)
    return total / (time.perf_counter() - start)


def bench_mp(n: int, tokens: int) -> float:
    client = SyncMPClient(ScriptedCore)
    try:
        start = time.perf_counter()
        for r in _requests(n, tokens):
            client.add_request(r)
        total = drain(client.get_output, n)
        return total / (time.perf_counter() - start)
    finally:
        client.shutdown()


def _tiny_llama_config(path: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits

    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(hf).save_pretrained(path, safe_serialization=True)
    return EngineConfig(
        model_config=ModelConfig.from_pretrained(path, dtype="float32", max_model_len=256),
        cache_config=CacheConfig(block_size=16, kv_cache_memory_bytes=64 << 20),
        scheduler_limits=SchedulerLimits(max_num_seqs=64, max_num_batched_tokens=512),
    )


def _greedy_requests(n: int, tokens: int) -> list[EngineCoreRequest]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(16)] for i in range(n)]
    return [EngineCoreRequest(f"r{i}", p, params, None, 0.0) for i, p in enumerate(prompts)]


def _timed_generation(client: InprocClient | SyncMPClient, n: int, tokens: int) -> float:
    """Tokens per second for `n` greedy requests, after one warm-up request."""
    warmup = _greedy_requests(1, 4)[0]
    client.add_request(EngineCoreRequest("warmup", *_fields(warmup)))
    drain(client.get_output, 1)
    start = time.perf_counter()
    for r in _greedy_requests(n, tokens):
        client.add_request(r)
    total = drain(client.get_output, n)
    return total / (time.perf_counter() - start)


def _fields(r: EngineCoreRequest) -> tuple[Any, ...]:
    return (r.prompt_token_ids, r.sampling_params, r.eos_token_id, r.arrival_time)


def bench_llama(n: int, tokens: int) -> dict[str, float]:
    import tempfile

    from paged.server.engine.core import make_engine_core_factory

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as path:
        config = _tiny_llama_config(path)
        for name, factory in (
            ("llama_inproc", make_engine_core_factory(config)),
            ("llama_batch_queue", make_engine_core_factory(config, batch_queue_size=2)),
        ):
            client = InprocClient.from_factory(factory)
            results[f"{name}_tokens_per_s"] = round(_timed_generation(client, n, tokens))
            client.shutdown()
        mp = SyncMPClient(make_engine_core_factory(config))
        try:
            results["llama_mp_tokens_per_s"] = round(_timed_generation(mp, n, tokens))
        finally:
            mp.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", action="store_true", help="also run a tiny Llama engine")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "bench": "server_core",
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "serial_us_per_batch": round(bench_serial(), 1),
        "inproc_tokens_per_s": round(bench_inproc(args.requests, args.tokens)),
        "mp_tokens_per_s": round(bench_mp(args.requests, args.tokens)),
    }
    if args.model:
        result.update(bench_llama(args.requests, args.tokens))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
