"""Structured output (llguidance) cost: compile, per-step masks, and end-to-end throughput.

On the default model (SmolLM2-135M-Instruct, the shipped GGUF; its 49,152-token
vocabulary is what masks cover):

- compile_ms: one nested JSON schema compiled cold (a fresh compiler) and
  cached (an LRU hit; each request then gets a deep copy of the matcher).
- mask_ms: `StructuredOutputBackend.grammar_bitmask` for 1 and 32 requests
  mid-way through a JSON object (the engine's per-step cost, the int32 array
  converted to the boundary's lists included), and the runner applying
  those 32 masks to float32 logits (`apply_grammar_bitmask`).
- step_overlap: real engine steps of 1 and 32 JSON-schema streams, with the
  mask overlapping the forward pass (`EngineCore.mask_overlap`, the default)
  and without (the mask computed after `execute_model`). Per step that
  computed a mask: `mask_ms` (the mask's own time, on whichever thread),
  `exposed_ms` (what the engine thread waited for it after the forward pass:
  the cost left on the step), `step_ms`, and their medians' shares of the step.
- throughput: output tokens/s of `--streams` requests constrained by a JSON
  schema against the same number unconstrained (same prompts, same
  max_tokens, `ignore_eos` for the unconstrained ones so both run to length),
  `--runs` rounds in alternating order; the ratio (constrained /
  unconstrained) is the median of the rounds' ratios, each round's pair
  measured back to back so that load drift cancels.

Each figure sits beside the load average and torch's thread count it was
measured under (the CPU is shared: read ratios, not absolutes).

Run: .venvs/all/bin/python benchmarks/structured_bench.py [--streams 32 --tokens 48 --runs 4]
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


class _StepTimer:
    """Wraps one EngineCore's step, mask computation and mask wait with timers."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.steps: list[tuple[float, float, float]] = []  # (step, mask, exposed) seconds
        self._mask = self._exposed = 0.0
        self._orig_step = core.step
        self._orig_mask = core.scheduler.get_grammar_bitmask
        self._orig_start = core.mask_overlap.start
        core.step = self._step
        core.scheduler.get_grammar_bitmask = self._timed_mask
        core.mask_overlap.start = self._start

    def close(self) -> None:
        del self.core.__dict__["step"]
        del self.core.scheduler.__dict__["get_grammar_bitmask"]
        del self.core.mask_overlap.__dict__["start"]

    def _timed_mask(self, so: Any) -> Any:
        t = time.perf_counter()
        out = self._orig_mask(so)
        self._mask += time.perf_counter() - t
        return out

    def _start(self, so: Any) -> Any:
        pending = self._orig_start(so)
        timer = self

        class _Timed:
            def result(self) -> Any:
                t = time.perf_counter()
                out = pending.result()
                timer._exposed += time.perf_counter() - t
                return out

        return _Timed()

    def _step(self) -> Any:
        self._mask = self._exposed = 0.0
        t = time.perf_counter()
        out = self._orig_step()
        elapsed = time.perf_counter() - t
        if self._mask > 0:
            self.steps.append((elapsed, self._mask, self._exposed))
        return out


def bench_step_overlap(llm: Any, tokens: int) -> dict[str, Any]:
    core = llm.engine_client.core
    constraint = StructuredOutputsParams(json=json.dumps(SCHEMA))
    out: dict[str, Any] = {}
    for batch in (1, 32):
        prompts = [f"Describe person number {i} as JSON." for i in range(batch)]
        params = [
            SamplingParams(max_tokens=tokens, seed=i, structured_outputs=constraint)
            for i in range(batch)
        ]
        llm.generate(prompts[:1], params[:1], use_tqdm=False)  # compile + warm up
        for overlap in (True, False):
            core.mask_overlap.enabled = overlap
            timer = _StepTimer(core)
            load = os.getloadavg()[0]
            try:
                llm.generate(prompts, params, use_tqdm=False)
            finally:
                timer.close()
            step, mask, exposed = (
                statistics.median(x[i] for x in timer.steps) * 1000 for i in range(3)
            )
            out[f"batch_{batch}_{'overlap' if overlap else 'no_overlap'}"] = {
                "steps": len(timer.steps),
                "step_ms": round(step, 3),
                "mask_ms": round(mask, 3),
                "exposed_ms": round(exposed, 3),
                "mask_share": round(mask / step, 4),
                "exposed_share": round(exposed / step, 4),
                "loadavg": round(load, 2),
            }
    core.mask_overlap.enabled = True
    return out


def bench_throughput(llm: Any, streams: int, tokens: int, runs: int) -> dict[str, Any]:
    prompts = [f"Describe person number {i} as JSON." for i in range(streams)]
    constraint = StructuredOutputsParams(json=json.dumps(SCHEMA))
    free = [SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i) for i in range(streams)]
    con = [
        SamplingParams(max_tokens=tokens, seed=i, structured_outputs=constraint)
        for i in range(streams)
    ]
    rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    ratios: list[float] = []
    load = os.getloadavg()[0]
    order = [("unconstrained", free), ("json_schema", con)]
    for run in range(runs):
        # Alternate which goes first: the shared CPU's load drifts between rounds.
        for name, params in order if run % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
        ratios.append(rates["json_schema"][-1] / rates["unconstrained"][-1])
    return {
        "streams": streams,
        "max_tokens": tokens,
        "runs": runs,
        "tok_s_median": {k: round(statistics.median(v), 1) for k, v in rates.items()},
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_per_round": [round(r, 3) for r in ratios],
        "loadavg_before": round(load, 2),
        "loadavg_after": round(os.getloadavg()[0], 2),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=4)
    args = parser.parse_args()
    from paged.server import LLM

    llm = LLM(max_model_len=1024)
    assert llm.grammar_compiler is not None
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (GGUF, CPU float32)",
        "vocab": llm.grammar_compiler.vocab_size,
        "torch_threads": torch.get_num_threads(),
        "loadavg_before": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    result.update(bench_compile_and_masks(llm))
    result["step_overlap"] = bench_step_overlap(llm, args.tokens)
    result["throughput"] = bench_throughput(llm, args.streams, args.tokens, args.runs)
    result["loadavg_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
