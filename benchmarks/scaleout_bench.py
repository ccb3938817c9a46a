"""Scale-out benchmark (JSON): executor overhead per step, and (part D) DP throughput.

`--part executor` measures what each executor adds to one engine step:

- `noop_rpc_us`: one `collective_rpc(CheckHealth())` round trip (a call every
  worker answers with nothing; no model work at all).
- `step_ms[batch]`: one decode step, `execute_model` + `sample_tokens`, for
  `batch` running requests on a near-empty model (1 layer, hidden 64, vocab
  128, random weights), so the model's own compute is a small constant; the
  SchedulerOutput and ModelRunnerOutput still grow with the batch, like the
  real step's messages.
- `overhead_vs_uni_ms[batch]`: step_ms minus the in-process `uni` executor's
  step_ms at the same batch: the cost of the executor's IPC alone.

Every executor runs one worker (TP=1 by default, `--tp 2` adds gloo
all-reduces on the worker side). `mp_2nodes` is the mp executor over two
"nodes" (`--nnodes 2`): node 1 is a `paged serve --headless --node-rank 1`
process on this machine holding half the ranks, driven over the TCP node link
on loopback (needs an even `--tp`; compare it with `mp` at the same `--tp`:
`step_over_mp` is the cost of the TCP hop and the agent's relay).

All executors are started first and then measured in turns (`--rounds`,
each `--steps` timed steps after 5 warm-up steps), so that load swings on a
shared machine hit them alike; the ratios are taken per round and their
median reported. Load average and thread counts are recorded beside the
figures. `ray` starts a local cluster (num_cpus = world size, no dashboard)
unless RAY_ADDRESS is set.

`--part dp` runs `benchmarks/scaleout_dp.py`'s `run_dp()` (data parallelism,
part D of issue 19) when that module exists, and says so when it does not.

    uv run --no-sync python benchmarks/scaleout_bench.py --part executor --steps 30
    uv run --no-sync python benchmarks/scaleout_bench.py --backends uni,mp,mp_2nodes --tp 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from paged.kvcache import get_kv_cache_config
from paged.runner.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerLimits,
)
from paged.runner.executor import Executor, create_executor
from paged.runner.executor.messages import CheckHealth
from paged.runner.executor.node_wire import free_port_pair
from paged.scheduler.boundary import CachedRequestData, NewRequestData, SchedulerOutput
from paged.scheduler.sampling_params import SamplingParams

BLOCK = 16
PROMPT_LEN = 8


def make_checkpoint(path: Path) -> Path:
    """A 1-layer llama with random weights: model compute stays a small constant."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    auto: Any = AutoModelForCausalLM
    auto.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    return path


def engine_config(
    path: Path, backend: str, tp: int, batch: int, master_port: int | None = None
) -> EngineConfig:
    """`master_port` set: the mp executor over 2 nodes, node 0's side (mp_2nodes)."""
    two_nodes = master_port is not None
    return EngineConfig(
        model_config=ModelConfig.from_pretrained(str(path), max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=64 << 20),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp,
            distributed_executor_backend=backend,  # type: ignore[arg-type]
            nnodes=2 if two_nodes else 1,
            master_addr="127.0.0.1" if two_nodes else None,
            master_port=master_port if master_port is not None else 29501,
        ),
        scheduler_limits=SchedulerLimits(max_num_seqs=batch, max_num_batched_tokens=2048),
    )


def start_node1(path: Path, tp: int, batch: int, port: int) -> subprocess.Popen[bytes]:
    """Node 1 of mp_2nodes: `paged serve --headless --node-rank 1` with engine_config's flags."""
    cmd = [sys.executable, "-m", "paged.server.cli", "--log-level", "warning", "serve",
           str(path), "--device", "cpu", "--max-model-len", "512", "--block-size", str(BLOCK),
           "--kv-cache-memory", "64MiB", "--max-num-seqs", str(batch),
           "--max-num-batched-tokens", "2048", "-tp", str(tp), "--nnodes", "2",
           "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
           "--headless"]  # fmt: skip
    return subprocess.Popen(cmd)


def blocks_per_request(steps: int, warmup: int) -> int:
    return -(-(PROMPT_LEN + steps + warmup + 1) // BLOCK)


def init_kv(executor: Executor, max_batch: int, blocks_per_req: int) -> None:
    kv = get_kv_cache_config(
        executor.get_kv_cache_specs(),
        executor.determine_available_memory(),
        num_gpu_blocks_override=1 + max_batch * blocks_per_req,
    )
    executor.initialize_from_config(kv)


def time_steps(
    executor: Executor,
    batch: int,
    steps: int,
    warmup: int,
    blocks_per_req: int,
    finished: list[str],
    tag: str,
) -> tuple[list[float], list[str]]:
    """Seconds per decode step of `batch` requests (one prefill, then decodes); their ids.

    `finished`: the previous batch's requests, retired in this batch's first step.
    """
    ids = [f"{tag}-r{i}" for i in range(batch)]
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    new = [
        NewRequestData(
            rid,
            [(5 + i + j) % 120 + 3 for j in range(PROMPT_LEN)],
            params,
            (list(range(1 + i * blocks_per_req, 1 + (i + 1) * blocks_per_req)),),
            0,
        )
        for i, rid in enumerate(ids)
    ]
    so = SchedulerOutput(
        scheduled_new_reqs=new,
        num_scheduled_tokens=dict.fromkeys(ids, PROMPT_LEN),
        total_num_scheduled_tokens=PROMPT_LEN * batch,
        finished_req_ids=finished,
    )
    executor.execute_model(so)
    executor.sample_tokens(None)
    times: list[float] = []
    for step in range(warmup + steps):
        so = SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(
                ids,
                [False] * batch,
                [[] for _ in ids],
                [None] * batch,
                [PROMPT_LEN + step] * batch,
                [step + 1] * batch,
            ),
            num_scheduled_tokens=dict.fromkeys(ids, 1),
            total_num_scheduled_tokens=batch,
        )
        start = time.perf_counter()
        executor.execute_model(so)
        executor.sample_tokens(None)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return times, ids


def time_noop_rpc(executor: Executor, n: int) -> list[float]:
    times = []
    for _ in range(n + 5):
        start = time.perf_counter()
        executor.collective_rpc(CheckHealth())
        times.append(time.perf_counter() - start)
    return times[5:]


def run_executor_part(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """All executors alive at once, measured in turns, so that load swings hit them alike."""
    batches = [int(b) for b in args.batches.split(",")]
    backends = args.backends.split(",")
    warmup = 5
    blocks_per_req = blocks_per_request(args.steps, warmup)
    executors: dict[str, Executor] = {}
    results: dict[str, Any] = {}
    node1: subprocess.Popen[bytes] | None = None
    try:
        for backend in backends:
            tp = 1 if backend == "uni" else args.tp
            began = time.perf_counter()
            if backend == "mp_2nodes":
                if tp % 2:
                    raise SystemExit("mp_2nodes needs an even --tp (each node holds tp / 2)")
                port = free_port_pair()
                node1 = start_node1(path, tp, max(batches), port)
                config = engine_config(path, "mp", tp, max(batches), master_port=port)
            else:
                config = engine_config(path, backend, tp, max(batches))
            executors[backend] = create_executor(config)
            results[backend] = {"tp": tp, "startup_s": round(time.perf_counter() - began, 1)}
            init_kv(executors[backend], max(batches), blocks_per_req)
        noop: dict[str, list[float]] = {b: [] for b in backends}
        steps: dict[str, dict[int, list[float]]] = {b: {n: [] for n in batches} for b in backends}
        round_medians: dict[str, dict[int, list[float]]] = {
            b: {n: [] for n in batches} for b in backends
        }
        finished: dict[str, list[str]] = {b: [] for b in backends}
        loads: list[float] = []
        for rnd in range(args.rounds):
            loads.append(round(os.getloadavg()[0], 2))
            for batch in batches:
                for backend in backends:
                    ex = executors[backend]
                    noop[backend] += time_noop_rpc(ex, 20)
                    times, finished[backend] = time_steps(
                        ex, batch, args.steps, warmup, blocks_per_req, finished[backend],
                        tag=f"{rnd}-{batch}",
                    )  # fmt: skip
                    steps[backend][batch] += times
                    round_medians[backend][batch].append(statistics.median(times))
    finally:
        for ex in executors.values():
            ex.shutdown()
        if node1 is not None:
            results["node1_exit_code"] = node1.wait(timeout=60)
    results["loadavg_1m_per_round"] = loads
    for backend in backends:
        results[backend]["noop_rpc_us"] = round(statistics.median(noop[backend]) * 1e6, 1)
        results[backend]["step_ms"] = {
            str(n): {
                "median_ms": round(statistics.median(t) * 1e3, 3),
                "p90_ms": round(sorted(t)[int(0.9 * (len(t) - 1))] * 1e3, 3),
                "round_medians_ms": [round(m * 1e3, 2) for m in round_medians[backend][n]],
            }
            for n, t in steps[backend].items()
        }
    for base_name in ("uni", "mp"):
        if base_name not in results:
            continue
        for backend in backends:
            if backend in (base_name, "uni"):  # uni is only ever the baseline
                continue
            # Per round (same moment, same load), then the median over rounds.
            results[backend][f"step_over_{base_name}"] = {
                str(n): round(
                    statistics.median(
                        a / b
                        for a, b in zip(
                            round_medians[backend][n], round_medians[base_name][n], strict=True
                        )
                    ),
                    2,
                )
                for n in batches
            }
            results[backend][f"overhead_vs_{base_name}_ms"] = {
                str(n): round(
                    (statistics.median(steps[backend][n]) - statistics.median(steps[base_name][n]))
                    * 1e3,
                    3,
                )
                for n in batches
            }
    return results


def run_dp_part(args: argparse.Namespace) -> dict[str, Any]:
    """Part D's DP=2 vs DP=1 throughput, imported lazily: it may not exist on this branch."""
    module_path = Path(__file__).with_name("scaleout_dp.py")
    if not module_path.exists():
        return {"status": "absent", "detail": f"{module_path.name} is not in this checkout"}
    spec = importlib.util.spec_from_file_location("scaleout_dp", module_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result: dict[str, Any] = module.run_dp()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["executor", "dp", "all"], default="executor")
    ap.add_argument(
        "--backends", default="uni,mp,ray", help="comma list of uni, mp, ray, mp_2nodes"
    )
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="turns over the executors")
    ap.add_argument("--tp", type=int, default=1, help="TP size of the mp and ray runs")
    args = ap.parse_args()
    out: dict[str, Any] = {
        "benchmark": "scaleout_bench",
        "argv": sys.argv[1:],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        # torch threads per worker process (unset: the cores / the node's ranks).
        "paged_worker_num_threads": os.environ.get("PAGED_WORKER_NUM_THREADS"),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
    }
    if args.part in ("executor", "all"):
        with tempfile.TemporaryDirectory() as tmp:
            path = make_checkpoint(Path(tmp) / "tiny-1layer")
            out["executor"] = {
                "what": "decode step (execute_model + sample_tokens) on a 1-layer hidden-64 "
                "model; noop_rpc = collective_rpc(CheckHealth)",
                "steps_per_round": args.steps,
                "rounds": args.rounds,
                **run_executor_part(args, path),
            }
    if args.part in ("dp", "all"):
        out["dp"] = run_dp_part(args)
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
