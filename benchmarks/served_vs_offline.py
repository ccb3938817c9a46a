"""The work of cpu_vs_llamacpp's scenarios (b) and (c), run offline: what serving adds.

Same prompts (`cpu_vs_llamacpp._prompt`, same seeds), same limits
(`max_num_seqs=32`, `max_model_len=2048`, greedy, `ignore_eos`, 128 tokens),
but through the in-process `LLM` (no HTTP, no API-server process, no ZMQ,
all requests added before the first step). Beside the output tok/s it prints
the engine step summary (`paged.server.engine.step_trace`: pure-decode vs
prefill steps, their wall time, decode batch) and the process CPU seconds per
output token; compare with the served run's `cpu_ms_per_output_token` and
`PAGED_STEP_TRACE` summary (`cpu_vs_llamacpp.py --trace-dir`). With
`--served FILE` (that script's JSON lines) it adds served/offline ratios.

    OMP_NUM_THREADS=1 .venvs/all/bin/python benchmarks/served_vs_offline.py --scenarios bc
Prints one JSON line per scenario.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import importlib.util
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from paged.scheduler import SamplingParams
from paged.server.engine.step_trace import StepTrace
from paged.server.llm import LLM


def _served_prompt_fn() -> Callable[[int, int], str]:
    """cpu_vs_llamacpp's own prompt builder (same words, same seeds), loaded from its file."""
    spec = importlib.util.spec_from_file_location(
        "cpu_vs_llamacpp", Path(__file__).with_name("cpu_vs_llamacpp.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return cast(Callable[[int, int], str], module._prompt)


_prompt = _served_prompt_fn()


def prompts_for(scenario: str) -> list[str]:
    if scenario == "b":
        rng = random.Random(7)
        return [_prompt(int(rng.uniform(24, 384)), i) for i in range(32)]
    return [_prompt(75, 100 + i) for i in range(32)]


def run(llm: LLM, scenario: str, max_tokens: int, trace_path: str) -> dict[str, Any]:
    core: Any = llm.engine_client.core  # type: ignore[attr-defined]
    trace = StepTrace(trace_path)
    original = core.step

    def traced_step() -> Any:
        trace.begin_step()
        out = original()
        trace.end_step(out)
        return out

    core.step = traced_step
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    load0 = os.getloadavg()[0]
    cpu0, t0 = time.process_time(), time.perf_counter()
    try:
        outs = llm.generate(prompts_for(scenario), params, use_tqdm=False)
    finally:
        core.step = original
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "scenario": scenario,
        "side": "paged offline (LLM)",
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2),
        "wall_s": round(wall, 2),
        "cpu_ms_per_output_token": round(1000 * cpu / tokens, 3),
        "cpu_share": round(cpu / wall, 2),
        "threads": int(os.environ["OMP_NUM_THREADS"]),
        "load_avg_before": load0,
        "load_avg_after": os.getloadavg()[0],
        "steps": trace.summary(),
    }


def served_lines(path: Path) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("side") == "paged" and "scenario" in row:
            found[row["scenario"]] = row
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="bc")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--served", type=Path, help="cpu_vs_llamacpp.py JSON lines to compare")
    args = parser.parse_args()
    llm = LLM(max_num_seqs=32, max_model_len=2048)
    llm.generate([_prompt(20, 999)], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    served = served_lines(args.served) if args.served else {}
    with tempfile.TemporaryDirectory() as tmp:
        for sc in args.scenarios:
            result = run(llm, sc, args.max_tokens, str(Path(tmp) / f"{sc}.json"))
            if sc in served:
                s = served[sc]
                result["served_output_tok_s"] = s["output_tok_s"]
                result["served_over_offline_tok_s"] = round(
                    s["output_tok_s"] / result["output_tok_s"], 3
                )
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
