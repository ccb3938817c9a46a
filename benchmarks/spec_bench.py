"""N-gram speculative decoding against plain decoding: decode tok/s, acceptance, same tokens.

Two offline engines (`LLM`) on the default model, one plain and one with
`--speculative-config` (n-gram), generate greedily (`ignore_eos`) on two
tasks, single-stream (1 request) and 8-stream (8 requests in one batch):

  copy  "repeat this code with one change": the answer copies its prompt
  free  a story: text that does not repeat its prompt

Decode tok/s excludes the prefill: the tokens after each request's first,
over the time from the batch's first token to its last (the frontend's
per-request token timestamps; all prompts prefill in one step). Rounds
alternate between the engines so load drift hits both; medians over
`--runs` rounds are reported with min/max, their ratio, the acceptance rate
(accepted / drafted tokens) and the mean accepted length per verification
step (1 + accepted / drafts, the tokens one target forward yields), whether
both engines produced identical tokens, the torch thread count and the load
average before and after.

Run: .venvs/all/bin/python benchmarks/spec_bench.py [--tokens 64 --runs 3 --k 7 --streams 1 8
     --draft-policy cost|fixed]
Prints one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
from typing import Any

import torch

from paged.scheduler import SamplingParams
from paged.server.llm import LLM

CODE = [
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    result = []\n"
    "    total = 0.0\n"
    "    for i, value in enumerate(values):\n"
    "        total += value\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        if i >= window - 1:\n"
    "            result.append(total / window)\n"
    "    return result\n",
    "class Counter:\n"
    "    def __init__(self):\n"
    "        self.counts = {}\n"
    "\n"
    "    def add(self, key, amount=1):\n"
    "        self.counts[key] = self.counts.get(key, 0) + amount\n"
    "\n"
    "    def most_common(self, n):\n"
    "        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)\n"
    "        return items[:n]\n"
    "\n"
    "    def total(self):\n"
    "        return sum(self.counts.values())\n",
]
TOPICS = ("a lighthouse keeper", "a lost violin", "a city under snow", "an old orchard")


def copy_prompts(n: int) -> list[str]:
    return [
        f"Repeat this code exactly, with one change: add a docstring.\n\n{CODE[i % 2]}\n"
        f"Here is the code again with the change:\n\n"
        for i in range(n)
    ]


def free_prompts(n: int) -> list[str]:
    return [
        f"Write a short story about {TOPICS[i % len(TOPICS)]} (story {i}).\n\n" for i in range(n)
    ]


class SpecCounter:
    """Sums the engine's spec-decoding stats by wrapping its output pull."""

    def __init__(self, llm: LLM) -> None:
        self.drafts = self.drafted = self.accepted = 0
        original = llm.engine_client.get_output

        def recording() -> Any:
            outputs = original()
            s = outputs.scheduler_stats
            if s is not None and s.spec_decoding_stats is not None:
                self.drafts += s.spec_decoding_stats.num_drafts
                self.drafted += s.spec_decoding_stats.num_draft_tokens
                self.accepted += s.spec_decoding_stats.num_accepted_tokens
            return outputs

        llm.engine_client.get_output = recording  # type: ignore[method-assign]


def decode_rate(llm: LLM, batch: list[str], tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tok/s of one batch: tokens after each request's first, over first -> last token."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(batch, params, use_tqdm=False)
    first = min(
        o.metrics.first_token_time for o in outs if o.metrics and o.metrics.first_token_time
    )
    last = max(o.metrics.last_token_time for o in outs if o.metrics and o.metrics.last_token_time)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return sum(len(x) - 1 for x in ids) / max(last - first, 1e-9), ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    ap.add_argument(
        "--dtype",
        default="float32",
        help="float32 (default: the figures in the runner README; batch-invariant, so "
        "'same_tokens' is exact) or auto (a quantized GGUF's int4 + bf16 path)",
    )
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=3)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument(
        "--draft-policy",
        choices=["cost", "fixed"],
        default="cost",
        help="speculative_config.draft_policy: cost model (default) or every match drafts k",
    )
    args = ap.parse_args()
    load_before = os.getloadavg()
    spec_config = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
        "draft_policy": args.draft_policy,
    }
    common: dict[str, Any] = {
        "device": "cpu",
        "dtype": args.dtype,
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 256 << 20,
        "enable_prefix_caching": False,  # rounds alike: no round starts from cached prompts
    }
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config=spec_config, **common)
    counter = SpecCounter(spec)
    cases: dict[str, Any] = {}
    try:
        for llm in (plain, spec):  # warm-up, not timed
            decode_rate(llm, copy_prompts(1), 4)
        for task, make in (("copy", copy_prompts), ("free", free_prompts)):
            for streams in args.streams:
                batch = make(streams)
                rates: dict[str, list[float]] = {"plain": [], "ngram": []}
                same = True
                counter.drafts = counter.drafted = counter.accepted = 0
                for _ in range(args.runs):
                    rate_plain, ids_plain = decode_rate(plain, batch, args.tokens)
                    rate_spec, ids_spec = decode_rate(spec, batch, args.tokens)
                    rates["plain"].append(rate_plain)
                    rates["ngram"].append(rate_spec)
                    same = same and ids_plain == ids_spec
                med = {name: statistics.median(r) for name, r in rates.items()}
                cases[f"{task}_{streams}_streams"] = {
                    **{
                        f"{name}_decode_tok_s": {
                            "median": round(med[name], 2),
                            "min": round(min(r), 2),
                            "max": round(max(r), 2),
                        }
                        for name, r in rates.items()
                    },
                    "ngram_over_plain": round(med["ngram"] / med["plain"], 3),
                    "acceptance_rate": round(counter.accepted / max(counter.drafted, 1), 3),
                    "mean_accepted_length": round(1 + counter.accepted / max(counter.drafts, 1), 3),
                    "num_drafts": counter.drafts,
                    "same_tokens": same,
                }
    finally:
        plain.shutdown()
        spec.shutdown()
    print(
        json.dumps(
            {
                "bench": "spec_decode_ngram",
                "model": args.model or "SmolLM2-135M-Instruct",
                "device": "cpu",
                "speculative_config": spec_config,
                "tokens_per_request": args.tokens,
                "runs": args.runs,
                "torch_threads": torch.get_num_threads(),
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                **cases,
            }
        )
    )


if __name__ == "__main__":
    main()
