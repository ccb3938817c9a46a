"""Cost of one Scheduler step (schedule() + update_from_output()) on CPU, no model.

Workloads: N running requests all decoding (N = 64, 256, 1024), and a mixed
step (256 decodes plus new prompts filling the rest of the token budget).
The runner's answer is precomputed, so only scheduler time is measured.
Prints one JSON line: microseconds per step and per request, and the two
halves of a step (`schedule_us`, `update_us`: schedule() and
update_from_output() apart), each the median over runs of per-run medians.

    .venv/bin/python benchmarks/scheduler_bench.py [--runs 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from paged.kvcache import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from paged.scheduler import EngineCoreRequest, ModelRunnerOutput, SamplingParams
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.scheduler import Scheduler

BLOCK_SIZE = 16


def make_scheduler(num_blocks: int, max_num_seqs: int, budget: int) -> Scheduler:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="bfloat16")
    kv = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["l0"], spec)])
    config = SchedulerConfig(
        max_model_len=8192, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget
    )
    return Scheduler(config, kv, BLOCK_SIZE, log_stats=True, hash_seed=0)


def request(i: int, prompt_len: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=f"req-{i}",
        prompt_token_ids=[(i * 31 + j) % 30000 + 1 for j in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=100_000, ignore_eos=True),
        eos_token_id=2,
        arrival_time=float(i),
    )


def step(sched: Scheduler, token: int) -> tuple[float, float]:
    """CPU seconds of schedule() and of update_from_output() in one step (runner excluded).

    CPU time, not wall time: benchmarks here share a loaded machine, and the
    scheduler is single-threaded pure Python, so its CPU time is its cost.
    """
    t0 = time.process_time()
    so = sched.schedule()
    t1 = time.process_time()
    ids = list(so.num_scheduled_tokens)
    # Decoding requests sample one token; partial prefill chunks sample nothing.
    reqs = sched.state.requests
    sampled = [[token] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
    mro = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled)
    t2 = time.process_time()
    sched.update_from_output(so, mro)
    t3 = time.process_time()
    return t1 - t0, t3 - t2


Timing = tuple[float, float, float]  # medians over steps: whole step, schedule, update


def medians(times: list[tuple[float, float]]) -> Timing:
    return (
        statistics.median(a + b for a, b in times),
        statistics.median(a for a, _ in times),
        statistics.median(b for _, b in times),
    )


def decode_bench(n: int, steps: int) -> Timing:
    sched = make_scheduler(num_blocks=n * 40 + 16, max_num_seqs=n, budget=max(8192, n))
    for i in range(n):
        sched.add_request(request(i, 128))
    while len(sched.state.running) < n or sched.state.waiting:  # prefill everything first
        step(sched, 7)
    times = [step(sched, 7 + (k % 5)) for k in range(steps)]
    return medians(times)


def mixed_bench(steps: int) -> Timing:
    n = 256
    sched = make_scheduler(num_blocks=30_000, max_num_seqs=1024, budget=2048)
    for i in range(n):
        sched.add_request(request(i, 64))
    while len(sched.state.running) < n:
        step(sched, 7)
    times = []
    next_id = n
    for k in range(steps):
        # Keep new prompts waiting so every step mixes 256+ decodes with prefill chunks.
        while len(sched.state.waiting) < 4:
            sched.add_request(request(next_id, 512))
            next_id += 1
        times.append(step(sched, 7 + (k % 5)))
    return medians(times)


def summarize(per_run: list[Timing], n: int | None = None) -> dict[str, float]:
    step_us, sched_us, update_us = (
        statistics.median(t[i] for t in per_run) * 1e6 for i in range(3)
    )
    out = {"us_per_step": round(step_us, 1)}
    if n is not None:
        out["us_per_request"] = round(step_us / n, 2)
    out["schedule_us"] = round(sched_us, 1)
    out["update_us"] = round(update_us, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    result: dict[str, object] = {"bench": "scheduler_step", "runs": args.runs, "unit": "us"}
    for n in (64, 256, 1024):
        result[f"decode_{n}"] = summarize(
            [decode_bench(n, args.steps) for _ in range(args.runs)], n
        )
    mixed = [mixed_bench(args.steps) for _ in range(args.runs)]
    result["mixed_256_decode_plus_prefill"] = summarize(mixed)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
