"""Engine-core IPC benchmark: msgpack framing cost and multiprocess token throughput.

A scripted core (no model) emits one token per request per step, so the
numbers measure the engine loop, the ZMQ sockets and msgpack, not a model:

- `serial_us_per_batch`: encode + decode of one EngineCoreOutputs of 64 outputs.
- `inproc_tokens_per_s`: tokens through InprocClient (no IPC), same core.
- `mp_tokens_per_s`: tokens through SyncMPClient (engine in its own process).

Run: .venv/bin/python benchmarks/server_core_bench.py [--requests 64 --tokens 64]
Prints one JSON line.
"""

from __future__ import annotations

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    result = {
        "bench": "server_core",
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "serial_us_per_batch": round(bench_serial(), 1),
        "inproc_tokens_per_s": round(bench_inproc(args.requests, args.tokens)),
        "mp_tokens_per_s": round(bench_mp(args.requests, args.tokens)),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
