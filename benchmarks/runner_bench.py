"""paged ModelRunner vs Hugging Face transformers forward, default SmolLM2-135M GGUF (CPU or CUDA).

Decode: B requests with a `--prompt-len` prompt each are prefilled, then
`--steps` greedy decode steps are timed, paged and HF alternately, and the
median step is reported (paged: execute_model + sample_tokens, i.e. input
preparation, forward, logits and sampling; HF: one forward with a
DynamicCache plus argmax). Prefill: one `--prefill-len` prompt, timed
`--prefill-runs` times, paged and HF alternately, median. Prints one JSON
line: steps/s and tokens/s per batch size, the prefill time, and the ratio
paged/HF (> 1 means paged is faster).

    .venv/bin/python benchmarks/runner_bench.py
    .venv/bin/python benchmarks/runner_bench.py --batch-sizes 1 8 --steps 3 --prefill-len 512
    python benchmarks/runner_bench.py --device cuda   # Triton backend, CUDA graphs, bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from paged.kvcache import get_kv_cache_config
from paged.runner.config import CacheConfig, ModelConfig, SchedulerLimits
from paged.runner.model_runner import ModelRunner
from paged.scheduler.boundary import CachedRequestData, NewRequestData, SchedulerOutput
from paged.scheduler.sampling_params import SamplingParams

BLOCK = 16


def build_runner(config: ModelConfig, max_seqs: int, max_tokens: int) -> ModelRunner:
    runner = ModelRunner(
        config,
        CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 30),
        SchedulerLimits(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens),
        config.device,
    )
    runner.load_model()
    specs = runner.get_kv_cache_spec()
    runner.initialize_kv_cache(get_kv_cache_config(specs, runner.determine_available_memory()))
    return runner


class Driver:
    """Scripted scheduler for the runner: contiguous blocks, chunked prefill, then decodes."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.next_block = 1
        self.step_id = 0

    def _blocks(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // BLOCK)
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def prefill(self, prompts: dict[str, list[int]], max_len: int, chunk: int) -> None:
        params = SamplingParams(temperature=0.0)
        news = [
            NewRequestData(rid, p, params, (self._blocks(max_len),), 0)
            for rid, p in prompts.items()
        ]
        pending = dict.fromkeys(prompts, 0)
        first = True
        while pending:
            plan: dict[str, int] = {}
            budget = chunk
            for rid, done in pending.items():
                take = min(len(prompts[rid]) - done, budget)
                if take <= 0:
                    break
                plan[rid] = take
                budget -= take
            # The first step sends every request as new (scheduled or not); later
            # steps send the ones being prefilled as cached requests.
            cached = [] if first else list(plan)
            so = SchedulerOutput(
                scheduled_new_reqs=news if first else [],
                scheduled_cached_reqs=CachedRequestData(
                    cached,
                    [False] * len(cached),
                    [[] for _ in cached],
                    [None] * len(cached),
                    [pending[r] for r in cached],
                    [0] * len(cached),
                ),
                num_scheduled_tokens=plan,
                total_num_scheduled_tokens=sum(plan.values()),
            )
            first = False
            self.runner.execute_model(so)
            self.runner.sample_tokens()
            for rid, n in plan.items():
                pending[rid] += n
                if pending[rid] >= len(prompts[rid]):
                    del pending[rid]

    def decode(self) -> None:
        runner = self.runner
        ids = list(runner.input_batch.req_ids) or list(runner.requests)
        states = [runner.requests[r] for r in ids]
        so = SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(
                ids,
                [False] * len(ids),
                [[] for _ in ids],
                [None] * len(ids),
                [s.num_tokens - 1 for s in states],
                [len(s.output_token_ids) for s in states],
            ),
            num_scheduled_tokens=dict.fromkeys(ids, 1),
            total_num_scheduled_tokens=len(ids),
        )
        runner.execute_model(so)
        runner.sample_tokens()


def paged_decoder(config: ModelConfig, batch: int, prompt_len: int, steps: int) -> Driver:
    """A runner with `batch` prefilled requests, after one warm-up decode step."""
    runner = build_runner(config, max(batch, 1), 2048)
    driver = Driver(runner)
    prompts = {f"r{i}": [(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)}
    driver.prefill(prompts, prompt_len + steps + 2, 2048)
    driver.decode()
    return driver


def interleaved_prefill(
    runner: ModelRunner, hf: Any, length: int, runs: int
) -> tuple[float, float]:
    """Median seconds for one `length`-token prefill (paged, HF), timed alternately `runs` times.

    `runner` needs room for `runs` + 1 requests of `length` tokens.
    """
    driver = Driver(runner)
    driver.prefill({"w": list(range(10, 42))}, 64, length)  # warm-up
    hf_prefill(hf, 32)  # warm-up
    prompt = [(j * 13) % 1000 + 10 for j in range(length)]
    paged_times, hf_times = [], []
    for i in range(runs):
        start = time.perf_counter()
        driver.prefill({f"p{i}": prompt}, length + 1, length)
        paged_times.append(time.perf_counter() - start)
        hf_times.append(hf_prefill(hf, length))
    return statistics.median(paged_times), statistics.median(hf_times)


def paged_weights(runner: ModelRunner) -> tuple[int, bool]:
    """Bytes of paged's weights (parameters, tied ones once, plus any CPU panel
    copies), and whether the panels were built."""
    model = runner.model
    assert isinstance(model, torch.nn.Module)
    found = [getattr(m, "cpu_panels", None) for m in model.modules()]
    panels = [p for p in found if isinstance(p, torch.Tensor)]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(p.numel() * p.element_size() for p in panels), bool(panels)


def load_hf(config: ModelConfig) -> Any:
    """transformers' model, weights read by transformers' own GGUF reader.

    `from_pretrained(gguf_file=...)` would need `accelerate`, which paged does
    not depend on; `load_gguf_checkpoint` is the reader it uses underneath.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    auto: Any = AutoModelForCausalLM
    model = auto.from_config(config.hf_config, dtype=torch.float32)
    path = str(config.weights_path)
    tensors = load_gguf_checkpoint(  # type: ignore[no-untyped-call]
        path, return_tensors=True, model_to_load=model
    )["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or any(m != "lm_head.weight" for m in missing):
        raise RuntimeError(f"HF GGUF load mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    # Same device and dtype as paged's model (bfloat16 on CUDA by default).
    return model.to(device=config.device, dtype=config.dtype).eval()


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work, so that wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFDecoder:
    """transformers forward with a DynamicCache for `batch` prefilled rows, after a warm-up step."""

    @torch.inference_mode()
    def __init__(self, model: Any, batch: int, prompt_len: int) -> None:
        from transformers import DynamicCache

        self.model = model
        ids = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
        self.cache = DynamicCache()
        out = model(
            torch.tensor(ids, device=model.device), past_key_values=self.cache, use_cache=True
        )
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)
        self.decode()

    @torch.inference_mode()
    def decode(self) -> None:
        out = self.model(self.next, past_key_values=self.cache, use_cache=True)
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(self.next.device)


def interleaved_decode(
    config: ModelConfig, hf: Any, batch: int, prompt_len: int, steps: int
) -> tuple[float, float]:
    """Median seconds per decode step (paged, HF), timing the two alternately.

    Alternating exposes both to the same background load, which on a shared
    machine moves far more than the difference being measured.
    """
    paged = paged_decoder(config, batch, prompt_len, steps)
    reference = HFDecoder(hf, batch, prompt_len)
    paged_times, hf_times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        paged.decode()
        paged_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        reference.decode()
        hf_times.append(time.perf_counter() - start)
    return statistics.median(paged_times), statistics.median(hf_times)


@torch.inference_mode()
def hf_prefill(model: Any, length: int) -> float:
    """Seconds for one HF forward over a `length`-token prompt, plus the next-token argmax."""
    ids = torch.tensor([[(j * 13) % 1000 + 10 for j in range(length)]], device=model.device)
    sync(ids.device)
    start = time.perf_counter()
    out = model(ids, use_cache=True)
    out.logits[:, -1].argmax(-1)
    sync(ids.device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--prefill-runs", type=int, default=3, help="alternated; median")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument(
        "--cpu-weight-panels",
        choices=["auto", "on", "off"],
        default="auto",
        help="paged's panelled weight copies for 2-128 rows (ModelConfig.cpu_weight_panels)",
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: Triton backend"
    )
    parser.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ModelConfig.from_pretrained(
        None,
        max_model_len=max(args.prefill_len + 64, 512),
        cpu_weight_panels=args.cpu_weight_panels,
        device=args.device,
        dtype=args.dtype,
    )
    hf = load_hf(config)
    decode: dict[str, Any] = {}
    for b in args.batch_sizes:
        paged_s, hf_s = interleaved_decode(config, hf, b, args.prompt_len, args.steps)
        decode[str(b)] = {
            "paged_steps_per_s": round(1 / paged_s, 3),
            "paged_tokens_per_s": round(b / paged_s, 2),
            "hf_steps_per_s": round(1 / hf_s, 3),
            "hf_tokens_per_s": round(b / hf_s, 2),
            "ratio_paged_over_hf": round(hf_s / paged_s, 3),
        }
    prefill_runner = build_runner(config, args.prefill_runs + 1, args.prefill_len)
    weight_bytes, panels_built = paged_weights(prefill_runner)
    paged_p, hf_p = interleaved_prefill(prefill_runner, hf, args.prefill_len, args.prefill_runs)
    result = {
        "bench": "runner",
        "model": f"SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to {config.dtype_name})",
        "device": config.device,
        "torch_threads": torch.get_num_threads(),
        "cpu_weight_panels": args.cpu_weight_panels,
        "cpu_weight_panels_built": panels_built,
        "paged_weight_mib": round(weight_bytes / 2**20, 1),
        "hf_weight_mib": round(
            sum(p.numel() * p.element_size() for p in hf.parameters()) / 2**20, 1
        ),
        "prompt_len": args.prompt_len,
        "decode_steps_timed": args.steps,
        "decode_statistic": "median seconds per step, paged and HF steps alternated",
        "decode": decode,
        "prefill": {
            "tokens": args.prefill_len,
            "runs": args.prefill_runs,
            "statistic": "median seconds, paged and HF runs alternated",
            "paged_s": round(paged_p, 3),
            "paged_tokens_per_s": round(args.prefill_len / paged_p, 1),
            "hf_s": round(hf_p, 3),
            "hf_tokens_per_s": round(args.prefill_len / hf_p, 1),
            "ratio_paged_over_hf": round(hf_p / paged_p, 3),
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
