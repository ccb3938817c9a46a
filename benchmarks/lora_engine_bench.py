"""LoRA serving cost on the default model: decode throughput with 0..8 distinct adapters.

The engine loop (Scheduler + UniProcExecutor + ModelRunner, no HTTP) runs
`--streams` greedy requests of `--max-tokens` output tokens on the default
SmolLM2-135M GGUF (quantised CPU path, bfloat16, one CPU thread), rows spread
round-robin over N distinct random adapters (all 7 target modules, every layer)
of each rank, and reports output tokens per second of process CPU time (a
shared machine's load does not count) against:

    "no_lora":     LoRA disabled (the fused C decoder layers for every step)
    "no_lora_per_op": LoRA disabled, fused layers off ($PAGED_CPU_FUSED_LAYERS=off):
                   the path a step with LoRA rows took before the fused layers could
                   add deltas (and still takes with $PAGED_CPU_LORA=off)
    "lora_0":      LoRA enabled, no adapter rows (must cost nothing)
    "lora_N_rR":   N distinct rank-R adapters (steps with LoRA rows stay in the fused C
                   layers, the deltas by cpu_kernels/lora_delta.c; with
                   $PAGED_CPU_LORA=off: per op, the torch ops)

and the time to first token of one request whose adapter must first be read
from disk (PEFT safetensors) against the same request with the adapter loaded.

Run: .venvs/all/bin/python benchmarks/lora_engine_bench.py [--quick]
Prints one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from paged.kvcache import get_kv_cache_config
from paged.runner.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerLimits,
)
from paged.runner.executor import UniProcExecutor
from paged.runner.lora.config import LoRAConfig
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.scheduler import Scheduler

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BLOCK = 16


def write_adapter(path: Path, cfg: ModelConfig, rank: int, seed: int) -> str:
    hf = cfg.text_config
    hidden, inter = int(hf.hidden_size), int(hf.intermediate_size)
    kv = int(hf.num_key_value_heads) * hidden // int(hf.num_attention_heads)
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (hidden, hidden), "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter), "down_proj": (inter, hidden)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(hf.num_hidden_layers)):
        for name in TARGETS:
            part = "self_attn" if name[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            n_in, n_out = dims[name]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"r": rank, "lora_alpha": rank, "target_modules": TARGETS}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


class Engine:
    """The engine loop on one executor; `run` returns (output tokens, CPU seconds, TTFTs)."""

    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None, streams: int) -> None:
        config = EngineConfig(
            model_config=cfg,
            cache_config=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=256 << 20),
            scheduler_limits=SchedulerLimits(max_num_seqs=streams, max_num_batched_tokens=512),
            parallel_config=ParallelConfig(cpu_threads=1),
            lora_config=lora,
        )
        self.executor = UniProcExecutor(config)
        kv = get_kv_cache_config(
            self.executor.get_kv_cache_specs(), self.executor.determine_available_memory()
        )
        self.executor.initialize_from_config(kv)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=cfg.max_model_len,
                max_num_seqs=streams,
                max_num_batched_tokens=512,
            ),
            kv,
            BLOCK,
        )
        self.count = 0

    def run(
        self, prompts: list[list[int]], adapters: list[tuple[str, str] | None], max_tokens: int
    ) -> tuple[int, float, list[float]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start_wall = time.perf_counter()
        first: dict[str, float] = {}
        for prompt, adapter in zip(prompts, adapters, strict=True):
            self.count += 1
            name, path = adapter if adapter is not None else (None, None)
            self.scheduler.add_request(
                EngineCoreRequest(
                    f"r{self.count}",
                    prompt,
                    params,
                    None,
                    time.time(),
                    lora_request=name,
                    lora_path=path,
                )
            )
        produced = 0
        cpu = time.process_time()
        while self.scheduler.has_requests():
            so = self.scheduler.schedule()
            out = self.executor.execute_model(so)
            if out is None:
                out = self.executor.sample_tokens(None)
            for outputs in self.scheduler.update_from_output(so, out).values():
                for o in outputs.outputs:
                    produced += len(o.new_token_ids)
                    first.setdefault(o.request_id, time.perf_counter() - start_wall)
        return produced, time.process_time() - cpu, list(first.values())

    def close(self) -> None:
        self.executor.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="rank 16 only; 0, 1 and 8 adapters")
    parser.add_argument("--lora-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig.from_pretrained(None, max_model_len=256)
    counts = [1, 8] if args.quick else [1, 4, 8]
    ranks = [16] if args.quick else [8, 16, 64]
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, 20000, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.streams)
    ]
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            r: [write_adapter(Path(tmp) / f"r{r}_{i}", cfg, r, i) for i in range(8)] for r in ranks
        }
        base = Engine(cfg, None, args.streams)
        n, secs, _ = base.run(prompts, [None] * args.streams, args.max_tokens)
        results["no_lora"] = n / secs
        base.close()
        os.environ["PAGED_CPU_FUSED_LAYERS"] = "off"
        per_op = Engine(cfg, None, args.streams)
        n, secs, _ = per_op.run(prompts, [None] * args.streams, args.max_tokens)
        results["no_lora_per_op"] = n / secs
        per_op.close()
        del os.environ["PAGED_CPU_FUSED_LAYERS"]
        for rank in ranks:
            # slots as wide as this rank (--max-lora-rank sized to the adapters served)
            lora = LoRAConfig(max_loras=8, max_lora_rank=rank, lora_dtype=args.lora_dtype)
            engine = Engine(cfg, lora, args.streams)
            if rank == ranks[0]:
                n, secs, _ = engine.run(prompts, [None] * args.streams, args.max_tokens)
                results["lora_0"] = n / secs
            for count in counts:
                rows = [
                    (f"r{rank}_{i % count}", paths[rank][i % count]) for i in range(args.streams)
                ]
                n, secs, _ = engine.run(prompts, list(rows), args.max_tokens)
                results[f"lora_{count}_r{rank}"] = n / secs
            if rank == ranks[-1]:
                # TTFT: an adapter not loaded yet (read from disk on the step) vs loaded
                cold = write_adapter(Path(tmp) / "cold", cfg, rank, 99)
                _, _, ttft_cold = engine.run(prompts[:1], [("cold", cold)], 1)
                _, _, ttft_warm = engine.run(prompts[:1], [("cold", cold)], 1)
                results["ttft_adapter_from_disk_s"] = ttft_cold[0]
                results["ttft_adapter_loaded_s"] = ttft_warm[0]
            engine.close()
    ratios = {
        k: round(v / results["no_lora"], 3)
        for k, v in results.items()
        if k.startswith(("lora_", "no_lora_"))
    }
    print(json.dumps({
        "bench": "lora_engine_bench", "model": "SmolLM2-135M-Instruct Q4 GGUF (quantised CPU path)",
        "streams": args.streams, "lora_dtype": args.lora_dtype, "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len,
        "threads": 1, "unit": "output tok/s of process CPU time",
        "results": {k: round(v, 3) for k, v in results.items()},
        "relative_to_no_lora": ratios, "load": os.getloadavg()[0], "machine": platform.machine(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
