"""Cost of a speculative verification step over M query rows, against a one-row decode step.

The cost-aware draft policy (`spec_decode/policy.py`) prices a step over M
rows (one per decoding request plus one per drafted position) as
`cost(M)` one-row steps. This measures that curve on the default model's
default path (the quantised GGUF: int4 weights, bf16 activations, one torch
thread) or, with `--dtype float32`, on the dequantised float32 path.

A `ModelRunner` with an n-gram `SpeculativeConfig` is driven directly (no
scheduler): each step re-scores the same positions (the scheduler's
rollback fields, `num_computed_tokens` / `num_output_tokens`, put the request
back where it was), so every timed step of a shape does exactly the same work:
input preparation, the forward over all M rows, logits for all M rows, the
rejection sampler and the n-gram proposer. Shapes:

  single   1 request, M rows = 1 position + (M - 1) drafts   (M = 1, 2, 4, ..., 64)
  streams  8 requests, M / 8 rows each                       (M = 8, 16, 32, 64)

Shapes are timed round-robin (`--rounds` rounds, so load drift hits all of
them alike); medians of wall time and of this thread's CPU time (with one
torch thread every kernel runs on the calling thread, so CPU time moves less
with other processes than wall time does). `cost` = median / median of the
one-row step; `streams` ratios are also given against the 8-row plain step.
Prints one JSON line.

    OMP_NUM_THREADS=1 .venvs/all/bin/python benchmarks/verify_cost.py
    OMP_NUM_THREADS=1 .venvs/all/bin/python benchmarks/verify_cost.py --dtype float32
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import time
from typing import Any

import torch

from paged.kvcache import get_kv_cache_config
from paged.runner.config import CacheConfig, ModelConfig, SchedulerLimits
from paged.runner.model_runner import ModelRunner
from paged.runner.spec_decode.config import SpeculativeConfig
from paged.scheduler.boundary import CachedRequestData, NewRequestData, SchedulerOutput
from paged.scheduler.sampling_params import SamplingParams

BLOCK = 16
PROMPT_LEN = 96
MAX_ROWS = 64


class VerifyDriver:
    """`num_reqs` prefilled requests whose verification step can be replayed with any k."""

    def __init__(self, config: ModelConfig, num_reqs: int) -> None:
        spec = SpeculativeConfig(
            method="ngram", num_speculative_tokens=MAX_ROWS - 1, draft_policy="fixed"
        )
        self.runner = ModelRunner(
            config,
            CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=256 << 20),
            SchedulerLimits(max_num_seqs=num_reqs, max_num_batched_tokens=2048),
            config.device,
            speculative_config=spec,
        )
        self.runner.load_model()
        specs = self.runner.get_kv_cache_spec()
        available = self.runner.determine_available_memory()
        self.runner.initialize_kv_cache(get_kv_cache_config(specs, available))
        blocks_per_req = -(-(PROMPT_LEN + MAX_ROWS + 2) // BLOCK)
        self.req_ids = [f"r{i}" for i in range(num_reqs)]
        params = SamplingParams(temperature=0.0)
        news = [
            NewRequestData(
                rid,
                [(31 * i + 7 * j) % 4000 + 100 for j in range(PROMPT_LEN)],
                params,
                (list(range(1 + i * blocks_per_req, 1 + (i + 1) * blocks_per_req)),),
                0,
            )
            for i, rid in enumerate(self.req_ids)
        ]
        prefill = SchedulerOutput(
            scheduled_new_reqs=news,
            num_scheduled_tokens=dict.fromkeys(self.req_ids, PROMPT_LEN),
            total_num_scheduled_tokens=PROMPT_LEN * num_reqs,
        )
        self.runner.execute_model(prefill)
        self.runner.sample_tokens()

    def step(self, drafts_per_req: int) -> None:
        """One verification step: every request re-scores its last token plus `drafts_per_req`."""
        ids = self.req_ids
        n = len(ids)
        # Drafts the target will reject (token ids it would not pick), so each
        # step appends one token, which the next step's rollback drops again.
        drafts = {rid: [3 + j for j in range(drafts_per_req)] for rid in ids}
        out = SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(
                ids, [False] * n, [[] for _ in ids], [None] * n, [PROMPT_LEN] * n, [1] * n
            ),
            num_scheduled_tokens=dict.fromkeys(ids, 1 + drafts_per_req),
            total_num_scheduled_tokens=n * (1 + drafts_per_req),
            scheduled_spec_decode_tokens=drafts if drafts_per_req else {},
        )
        self.runner.execute_model(out)
        self.runner.sample_tokens()


def timed(driver: VerifyDriver, drafts: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    driver.step(drafts)
    return time.perf_counter() - t0, time.thread_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto", help="auto: the default path; float32: dequantised")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    load_before = os.getloadavg()
    config = ModelConfig.from_pretrained(None, dtype=args.dtype, max_model_len=512)
    single = VerifyDriver(config, 1)
    streams = VerifyDriver(config, 8)
    shapes: dict[str, tuple[VerifyDriver, int]] = {}
    for m in (1, 2, 4, 8, 16, 32, 64):
        shapes[f"single_{m}"] = (single, m - 1)
    for m in (8, 16, 32, 64):
        shapes[f"streams_{m}"] = (streams, m // 8 - 1)
    for driver, drafts in shapes.values():  # warm-up
        driver.step(drafts)
    wall: dict[str, list[float]] = {name: [] for name in shapes}
    cpu: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(args.rounds):
        for name, (driver, drafts) in shapes.items():
            w, c = timed(driver, drafts)
            wall[name].append(w)
            cpu[name].append(c)
    med_wall = {name: statistics.median(v) for name, v in wall.items()}
    med_cpu = {name: statistics.median(v) for name, v in cpu.items()}
    base_wall, base_cpu = med_wall["single_1"], med_cpu["single_1"]
    rows: dict[str, Any] = {}
    for name in shapes:
        rows[name] = {
            "wall_ms": round(med_wall[name] * 1e3, 2),
            "cpu_ms": round(med_cpu[name] * 1e3, 2),
            "cost_wall": round(med_wall[name] / base_wall, 3),
            "cost_cpu": round(med_cpu[name] / base_cpu, 3),
        }
        if name.startswith("streams"):
            rows[name]["over_8_row_decode_cpu"] = round(med_cpu[name] / med_cpu["streams_8"], 3)
    print(
        json.dumps(
            {
                "bench": "verify_cost",
                "model": "SmolLM2-135M-Instruct (GGUF Q4_1)",
                "dtype": config.dtype_name,
                "quantization": config.quantization,
                "device": config.device,
                "rounds": args.rounds,
                "statistic": "median per shape, shapes round-robin; cost = over single_1",
                "torch_threads": torch.get_num_threads(),
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                "shapes": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
