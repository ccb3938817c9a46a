"""The torch ops of ONE decoder layer at a batch-1 decode step of the default model (JSON).

Runs a short generation through `LLM`, captures the arguments of one decoder
layer's forward at a one-token decode step, then replays that layer alone:
its engine-thread CPU time per call (median of rounds), and under
torch.profiler (record_shapes) its ops per call, top-level and nested,
counted by kind. Ops that run inside paged's C step ops do not appear (one
ctypes call replaces them); the CPU time includes them.

    OMP_NUM_THREADS=1 .venvs/all/bin/python benchmarks/layer_ops.py
    PAGED_CPU_STEP_OPS=off ... layer_ops.py          # the torch-only path
    PYTHONPATH=<checkout>/packages/runner/src ...    # another checkout's runner

Replaying a layer rewrites the same K/V into the same cache slots, so the
cache is unchanged. The quantised path's fused decoder stack (cpu_step/fused.py)
never calls the layer modules, so this benchmark turns it off
($PAGED_CPU_FUSED_LAYERS=off unless set): it measures the per-op layer.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from paged.scheduler import SamplingParams
from paged.server.llm import LLM

os.environ.setdefault("PAGED_CPU_FUSED_LAYERS", "off")  # read when the model first runs


def _capture_layer_args(llm: LLM, layer_index: int, prompt_len: int) -> tuple[Any, Any]:
    core: Any = llm.engine_client.core  # type: ignore[attr-defined]
    layer = core.model_executor.worker.model_runner.model.model.layers[layer_index]
    captured: dict[str, Any] = {}

    def hook(_module: Any, args: Any) -> None:
        if args[1].shape[0] == 1:  # hidden_states [1, H]: a one-token decode step
            captured["args"] = args

    handle = layer.register_forward_pre_hook(hook)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts: list[Any] = [{"prompt_token_ids": list(range(100, 100 + prompt_len))}]
    llm.generate(prompts, params, use_tqdm=False)
    handle.remove()
    return layer, captured["args"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    llm = LLM(None, max_num_seqs=4)
    layer, layer_args = _capture_layer_args(llm, args.layer, args.prompt_len)
    rounds: list[float] = []
    with torch.inference_mode():
        for _ in range(20):
            layer(*layer_args)
        for _ in range(5):
            t0 = time.thread_time()
            for _ in range(args.calls):
                layer(*layer_args)
            rounds.append((time.thread_time() - t0) / args.calls * 1e6)
        calls = 10
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(calls):
                layer(*layer_args)
    events = [e for e in prof.events() if "::" in e.name]
    nested = collections.Counter(e.name for e in events)
    top = collections.Counter(
        e.name for e in events if e.cpu_parent is None or "::" not in e.cpu_parent.name
    )
    print(
        json.dumps(
            {
                "label": args.label,
                "layer": args.layer,
                "context_tokens": args.prompt_len + 7,
                "layer_cpu_us_median": round(statistics.median(rounds), 1),
                "layer_cpu_us_rounds": [round(r, 1) for r in rounds],
                "ops_per_layer_nested": sum(nested.values()) / calls,
                "ops_per_layer_top_level": sum(top.values()) / calls,
                "top_level_by_kind": {k: v / calls for k, v in top.most_common()},
                "nested_by_kind": {k: v / calls for k, v in nested.most_common(25)},
                "threads": torch.get_num_threads(),
                "load_avg": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
