"""--kv-cache-dtype on CPU: KV blocks per byte budget, decode speed, agreement with "auto" (JSON).

For each cache dtype the default model (SmolLM2-135M-Instruct GGUF; on CPU its
weights stay quantised and activations are bfloat16, so "auto" is a bfloat16
cache; `--dtype float32` dequantises, "auto" is then float32) runs offline
with one KV budget: `--num-prompts` prompts x `--max-tokens` greedy tokens in
one batch. One JSON line per dtype:

    num_gpu_blocks     blocks the budget holds (block_size 16)
    kv_bytes_per_token KV bytes one token takes over all layers
    capacity_vs_auto   num_gpu_blocks / auto's
    tokens_per_s       generated tokens / wall time of generate() (prefill included)
    prefix_agreement   mean over prompts of identical greedy tokens before the
                       first divergence from auto's, / max_tokens
    exact_match        fraction of prompts whose tokens all equal auto's

On CPU an fp8 cache goes through the torch attention backend (gather the fp8
blocks, dequantise, SDPA); "auto" with bfloat16 uses the C attention kernel,
which reads bfloat16 caches only. fp8 saves memory here, not time.

    OMP_NUM_THREADS=1 .venvs/all/bin/python benchmarks/kv_cache_dtype_bench.py
    .venvs/all/bin/python benchmarks/kv_cache_dtype_bench.py --dtype float32 --num-prompts 4
"""

from __future__ import annotations

import argparse
import json
import time

import torch

TOPICS = [
    "the history of Rome", "how rain forms", "a recipe for bread", "black holes",
    "learning to swim", "photosynthesis", "the moon landing", "volcanoes",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="model dtype (auto: bf16 on quantised)")
    parser.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="bytes")
    parser.add_argument(
        "--kv-cache-dtypes", default="auto,float16,fp8,fp8_e5m2", help="comma-separated"
    )
    parser.add_argument("--model", help="GGUF file or HF directory (default: SmolLM2 GGUF)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from paged.kvcache.specs import get_dtype_size
    from paged.runner.config import ModelConfig
    from paged.runner.kv_cache_dtype import kv_cache_spec_dtype
    from paged.scheduler import SamplingParams
    from paged.server.llm import LLM

    model_config = ModelConfig.from_pretrained(args.model, dtype=args.dtype)
    text = model_config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    values_per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim

    prompts = [f"Write about {TOPICS[i % len(TOPICS)]}." for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    names = args.kv_cache_dtypes.split(",")
    if names[0] != "auto":
        names.insert(0, "auto")
    base_tokens: list[list[int]] = []
    base_blocks = 0
    for name in names:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            max_model_len=1024,
            kv_cache_memory_bytes=args.kv_cache_memory,
            kv_cache_dtype=name,
        )
        try:
            blocks = llm.engine_client.info.num_gpu_blocks
            llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
        finally:
            llm.shutdown()
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if name == "auto":
            base_tokens, base_blocks = tokens, blocks
        prefixes, exact = [], 0
        for ref, got in zip(base_tokens, tokens, strict=True):
            same = next(
                (i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), len(ref)
            )
            prefixes.append(same / len(ref))
            exact += same == len(ref)
        record = {
            "bench": "kv_cache_dtype",
            "kv_cache_dtype": name,
            "model_dtype": args.dtype,
            "kv_cache_memory_bytes": args.kv_cache_memory,
            "num_gpu_blocks": blocks,
            "kv_bytes_per_token": values_per_token
            * get_dtype_size(kv_cache_spec_dtype(name, model_config.dtype_name)),
            "capacity_vs_auto": round(blocks / base_blocks, 3),
            "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens,
            "threads": args.threads,
            "tokens_per_s": round(args.num_prompts * args.max_tokens / wall, 1),
            "prefix_agreement": round(sum(prefixes) / len(prefixes), 3),
            "exact_match": exact / len(tokens),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
