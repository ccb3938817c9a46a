"""Cost of one Scheduler step (schedule() + update_from_output()) on CPU, no model.

Workloads: N running requests all decoding (N = 64, 256, 1024), and a mixed
step (256 decodes plus new prompts filling the rest of the token budget).
The runner's answer is precomputed, so only scheduler time is measured.
Prints one JSON line: microseconds per step and per request, median of runs.

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


def step(sched: Scheduler, token: int) -> float:
    """CPU seconds the scheduler spends on one step (the fake runner excluded).

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
    return (t1 - t0) + (t3 - t2)


def decode_bench(n: int, steps: int) -> float:
    sched = make_scheduler(num_blocks=n * 40 + 16, max_num_seqs=n, budget=max(8192, n))
    for i in range(n):
        sched.add_request(request(i, 128))
    while len(sched.state.running) < n or sched.state.waiting:  # prefill everything first
        step(sched, 7)
    times = [step(sched, 7 + (k % 5)) for k in range(steps)]
    return statistics.median(times)


def mixed_bench(steps: int) -> float:
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
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    result: dict[str, object] = {"bench": "scheduler_step", "runs": args.runs, "unit": "us"}
    for n in (64, 256, 1024):
        per_run = [decode_bench(n, args.steps) for _ in range(args.runs)]
        med = statistics.median(per_run) * 1e6
        result[f"decode_{n}"] = {"us_per_step": round(med, 1), "us_per_request": round(med / n, 2)}
    per_run = [mixed_bench(args.steps) for _ in range(args.runs)]
    med = statistics.median(per_run) * 1e6
    result["mixed_256_decode_plus_prefill"] = {"us_per_step": round(med, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
