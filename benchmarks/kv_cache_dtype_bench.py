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
    top1_agreement     teacher-forced: auto's sequences fed back as prompts
                       (prompt_logprobs=1); fraction of the generated positions
                       whose most likely token equals auto's there
    mean_abs_dlogprob  mean |logprob(token) - auto's| over those positions (nats)

Greedy agreement compounds: one near-tie flip changes the rest of a sequence,
and a cache dtype other than auto also changes the attention path (see below),
so top1_agreement is the per-step figure to read.

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
from typing import Any

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
    from paged.server.engine.client import InprocClient
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
    sequences: list[list[int]] = []
    base_forced: list[list[tuple[int, float]]] = []
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
            client = llm.engine_client
            # LLM(model) runs its engine core in-process; its info has the block count.
            assert isinstance(client, InprocClient), type(client)
            blocks = client.info.num_gpu_blocks
            llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            if name == "auto":
                base_tokens, base_blocks = tokens, blocks
                sequences = [
                    list(o.prompt_token_ids or []) + t for o, t in zip(outs, tokens, strict=True)
                ]
            forced = _teacher_forced(llm, sequences, args.max_tokens)
        finally:
            llm.shutdown()
        if name == "auto":
            base_forced = forced
        pairs = [
            (a, b)
            for ref, got in zip(base_forced, forced, strict=True)
            for a, b in zip(ref, got, strict=True)
        ]
        top1 = sum(a[0] == b[0] for a, b in pairs) / len(pairs)
        dlogprob = sum(abs(a[1] - b[1]) for a, b in pairs) / len(pairs)
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
            "top1_agreement": round(top1, 4),
            "mean_abs_dlogprob": round(dlogprob, 4),
        }
        print(json.dumps(record), flush=True)


def _teacher_forced(llm: Any, sequences: list[list[int]], generated: int) -> list[Any]:
    """Per sequence, per generated position: (most likely token, logprob of the actual one)."""
    from paged.scheduler import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate(sequences, params, use_tqdm=False)
    result = []
    for seq, out in zip(sequences, outs, strict=True):
        rows = []
        for pos in range(len(seq) - generated, len(seq)):
            entry = out.prompt_logprobs[pos]
            best = next(tok for tok, lp in entry.items() if lp.rank == 1)
            rows.append((best, entry[seq[pos]].logprob))
        result.append(rows)
    return result


if __name__ == "__main__":
    main()
