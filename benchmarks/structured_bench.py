"""Structured output (llguidance) cost: compile, per-step masks, and end-to-end throughput.

On the default model (SmolLM2-135M-Instruct, the shipped GGUF; its 49,152-token
vocabulary is what masks cover):

- compile_ms: one nested JSON schema compiled cold (a fresh compiler) and
  cached (an LRU hit; each request then gets a deep copy of the matcher).
- mask_ms: `StructuredOutputBackend.grammar_bitmask` for 1 and 32 requests
  mid-way through a JSON object (the engine's per-step cost, the int32 array
  converted to the boundary's lists included), and the runner applying
  those 32 masks to float32 logits (`apply_grammar_bitmask`).
- throughput: output tokens/s of `--streams` requests constrained by a JSON
  schema against the same number unconstrained (same prompts, same
  max_tokens, `ignore_eos` for the unconstrained ones so both run to length),
  best of `--runs` alternating rounds; ratio = constrained / unconstrained.

Run: .venvs/all/bin/python benchmarks/structured_bench.py [--streams 32 --tokens 48 --runs 2]
Prints one JSON object.
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

from paged.scheduler import SamplingParams, StructuredOutputsParams
from paged.scheduler.boundary import SchedulerOutput
from paged.scheduler.request import Request

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "tags", "address", "role"],
}
PREFIX = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "eng'


def _ms(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return round(statistics.median(times), 3)


def bench_compile_and_masks(llm: Any) -> dict[str, Any]:
    from paged.runner.runner_output import apply_grammar_bitmask
    from paged.server.structured_output import GrammarCompiler, StructuredOutputBackend, grammar_key

    compiler = llm.grammar_compiler
    constraint = StructuredOutputsParams(json=json.dumps(SCHEMA))
    key = grammar_key(constraint)
    cold = []
    for _ in range(5):
        fresh = GrammarCompiler(compiler.tokenizer)
        t = time.perf_counter()
        fresh.compile(key)
        cold.append((time.perf_counter() - t) * 1000)
    compiler.compile(key)
    cached = _ms(lambda: compiler.new_matcher(key), 50)
    prefix = llm.tokenizer.encode(PREFIX, add_special_tokens=False)
    out: dict[str, Any] = {
        "compile_ms": {"cold": round(statistics.median(cold), 3), "cached": cached},
        "mask_ms": {},
    }
    vocab = compiler.vocab_size
    for batch in (1, 32):
        backend = StructuredOutputBackend(compiler)
        reqs = []
        for i in range(batch):
            params = SamplingParams(structured_outputs=constraint)
            r = Request(str(i), [1, 2, 3], params, None, max_model_len=4096)
            r.num_computed_tokens = r.num_tokens
            reqs.append(r)
        so = SchedulerOutput(num_scheduled_tokens={r.request_id: 1 for r in reqs})
        backend.grammar_bitmask(reqs, so)  # creates the matchers
        for r in reqs:
            assert backend.accept_tokens(r.request_id, prefix)
        out["mask_ms"][f"batch_{batch}"] = _ms(
            lambda b=backend, q=reqs, s=so: b.grammar_bitmask(q, s), 30
        )
        if batch == 32:
            grammar = backend.grammar_bitmask(reqs, so)
            assert grammar is not None
            logits = torch.randn(batch, vocab)
            ids = [r.request_id for r in reqs]
            out["mask_ms"]["apply_batch_32"] = _ms(
                lambda x=logits, i=ids, g=grammar: apply_grammar_bitmask(x, i, g), 30
            )
    return out


def bench_throughput(llm: Any, streams: int, tokens: int, runs: int) -> dict[str, Any]:
    prompts = [f"Describe person number {i} as JSON." for i in range(streams)]
    constraint = StructuredOutputsParams(json=json.dumps(SCHEMA))
    free = [SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i) for i in range(streams)]
    con = [
        SamplingParams(max_tokens=tokens, seed=i, structured_outputs=constraint)
        for i in range(streams)
    ]
    best = {"unconstrained": 0.0, "json_schema": 0.0}
    for _ in range(runs):
        for name, params in (("unconstrained", free), ("json_schema", con)):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            best[name] = max(best[name], n / elapsed)
    return {
        "streams": streams,
        "max_tokens": tokens,
        "tok_s": {k: round(v, 1) for k, v in best.items()},
        "ratio": round(best["json_schema"] / best["unconstrained"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    from paged.server import LLM

    llm = LLM(max_model_len=1024)
    assert llm.grammar_compiler is not None
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (GGUF, CPU float32)",
        "vocab": llm.grammar_compiler.vocab_size,
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": round(os.getloadavg()[0], 2),
    }
    result.update(bench_compile_and_masks(llm))
    result["throughput"] = bench_throughput(llm, args.streams, args.tokens, args.runs)
    result["loadavg_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
