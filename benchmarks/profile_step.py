"""Profile engine steps of the default model (quantised GGUF path by default) on CPU.

For each batch size (default 1 and 32) the same offline generation runs three
times through `LLM` (in-process engine: schedule, prepare inputs, forward,
sample, update, detokenize):

    timed     no profiler: every engine step is timed (wall clock, and CPU time
              of the engine thread: see _wrap_step); the median pure-decode
              step (every scheduled request takes one token) is the figure
    cprofile  cProfile over the generation: the top functions by self time and
              the cumulative time of each phase of the step (schedule, update
              states, prepare inputs, forward, logits, sample, build output,
              scheduler update, output processing / detokenize)
    torch     torch.profiler (record_shapes): the top ops by self CPU time and
              "kernel" time = the sum of every op's self time; python time =
              wall time of the steps minus kernel time (module calls, glue)

cProfile and torch.profiler slow Python down, so their absolute figures are
above the `timed` ones; read them as shares. Prints one JSON line per batch
size, then nothing else on stdout (logs go to stderr).

    OMP_NUM_THREADS=1 .venvs/all/bin/python benchmarks/profile_step.py
    .venvs/all/bin/python benchmarks/profile_step.py --batch-sizes 1 --tokens 32 --dtype float32
    # before/after on a shared machine: alternate two checkouts' runner code
    PYTHONPATH=/tmp/before/packages/runner/src .venvs/all/bin/python benchmarks/profile_step.py \
        --timed-only --label before
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from paged.scheduler import SamplingParams
from paged.server.llm import LLM

# Phase name -> (file path fragment, function name) whose cumulative time is the phase's.
PHASES: dict[str, tuple[str, str]] = {
    "schedule": ("scheduler/scheduler.py", "schedule"),
    "update_states": ("runner/state_updates.py", "update_states"),
    "prepare_inputs": ("runner/input_prep.py", "prepare_inputs"),
    "forward": ("runner/model_runner.py", "_forward"),
    "compute_logits": ("runner/models/", "compute_logits"),
    "sample": ("runner/sampler/sampler.py", "__call__"),
    "build_output": ("runner/runner_output.py", "build_output"),
    "scheduler_update": ("scheduler/scheduler.py", "update_from_output"),
    "output_processing": ("server/output_processor.py", "process_outputs"),
    "engine_step": ("engine/core.py", "step"),
}


def _prompts(batch: int, prompt_len: int) -> list[list[int]]:
    # Token ids well inside any vocabulary, different per request (no prefix hits).
    return [[100 + (7 * r + 13 * i) % 5000 for i in range(prompt_len)] for r in range(batch)]


def _wrap_step(llm: LLM, times: list[tuple[float, float, bool]]) -> Callable[[], None]:
    """Time every engine step (wall, this thread's CPU); record whether it was pure decode.

    With one torch thread every kernel runs on the calling thread, so its CPU
    time is the step's compute without the time spent waiting for a core that
    other processes hold: on a shared machine it moves far less than wall time.
    """
    core: Any = llm.engine_client.core  # type: ignore[attr-defined]
    original = core.step
    scheduler = core.scheduler

    def timed_step() -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = original()
        last = scheduler_last[0]
        times.append((time.perf_counter() - t0, time.thread_time() - c0, last))
        return out

    scheduler_last = [False]
    original_schedule = scheduler.schedule

    def schedule() -> Any:
        so = original_schedule()
        counts = so.num_scheduled_tokens
        scheduler_last[0] = bool(counts) and all(n == 1 for n in counts.values())
        return so

    core.step = timed_step
    scheduler.schedule = schedule

    def restore() -> None:
        core.step = original
        scheduler.schedule = original_schedule

    return restore


def _generate(llm: LLM, batch: int, prompt_len: int, tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts: list[Any] = [{"prompt_token_ids": p} for p in _prompts(batch, prompt_len)]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def _phases(stats: pstats.Stats) -> dict[str, float]:
    found: dict[str, float] = {}
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (path, _line, func), (_cc, _nc, _tt, ct, _callers) in raw.items():
        for phase, (fragment, name) in PHASES.items():
            if func == name and fragment in path.replace(os.sep, "/"):
                found[phase] = round(found.get(phase, 0.0) + ct, 4)
    return found


def _top_functions(stats: pstats.Stats, n: int) -> list[dict[str, Any]]:
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    rows = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    out = []
    for (path, line, func), (_cc, nc, tt, ct, _callers) in rows:
        short = "/".join(path.split(os.sep)[-2:]) if path != "~" else "builtin"
        out.append(
            {"function": f"{short}:{line}:{func}", "calls": nc, "self_s": round(tt, 4),
             "cum_s": round(ct, 4)}
        )  # fmt: skip
    return out


def profile_batch(
    llm: LLM, batch: int, prompt_len: int, tokens: int, top: int, timed_only: bool = False
) -> dict[str, Any]:
    result: dict[str, Any] = {"batch": batch, "prompt_len": prompt_len, "tokens": tokens}
    # timed
    times: list[tuple[float, float, bool]] = []
    restore = _wrap_step(llm, times)
    try:
        result["wall_s"] = round(_generate(llm, batch, prompt_len, tokens), 4)
    finally:
        restore()
    decode = [t for t, _, is_decode in times if is_decode]
    decode_cpu = [c for _, c, is_decode in times if is_decode]
    result["steps"] = len(times)
    result["decode_steps"] = len(decode)
    result["decode_step_ms_median"] = round(1000 * statistics.median(decode), 3) if decode else None
    result["decode_tok_s"] = round(batch / statistics.median(decode), 2) if decode else None
    if decode_cpu:
        result["decode_step_cpu_ms_median"] = round(1000 * statistics.median(decode_cpu), 3)
        result["decode_step_cpu_ms_min"] = round(1000 * min(decode_cpu), 3)
    if timed_only:
        return result
    # cProfile
    profiler = cProfile.Profile()
    profiler.enable()
    wall = _generate(llm, batch, prompt_len, tokens)
    profiler.disable()
    stats = pstats.Stats(profiler)
    result["cprofile"] = {
        "wall_s": round(wall, 4),
        "phases_cum_s": _phases(stats),
        "top_self": _top_functions(stats, top),
    }
    # torch.profiler
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        wall = _generate(llm, batch, prompt_len, tokens)
    events = prof.key_averages(group_by_input_shape=False)
    # Self time of aten ops (what runs in C++ kernels), excluding the profiler's
    # own wrappers and Python-function events.
    op_events = [e for e in events if e.key.startswith("aten::") or "::" in e.key]
    kernel_us = sum(e.self_cpu_time_total for e in op_events)
    top_ops = sorted(op_events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    result["torch_profiler"] = {
        "wall_s": round(wall, 4),
        "kernel_s": round(kernel_us / 1e6, 4),
        "python_s": round(wall - kernel_us / 1e6, 4),
        "kernel_share": round(kernel_us / 1e6 / wall, 3),
        "ops_per_step": round(sum(e.count for e in op_events) / max(1, result["steps"]), 1),
        "top_self": [
            {"op": e.key, "calls": e.count, "self_s": round(e.self_cpu_time_total / 1e6, 4)}
            for e in top_ops
        ],
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the SmolLM2-135M GGUF")
    parser.add_argument("--dtype", default="auto", help="auto = int4 + bf16 for a quantised GGUF")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--batch-prompt-len", type=int, default=32, help="prompt length, batch > 1")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--label", default="", help="free text copied into each line")
    parser.add_argument("--timed-only", action="store_true", help="skip both profilers")
    args = parser.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes))
    load_s = time.perf_counter() - t0  # model load + kernel packing (+ a first compile)
    _generate(llm, 1, 16, 4)  # warm-up: first-call allocations, lazy inits
    for batch in args.batch_sizes:
        prompt_len = args.prompt_len if batch == 1 else args.batch_prompt_len
        line = profile_batch(llm, batch, prompt_len, args.tokens, args.top, args.timed_only)
        line["label"] = args.label
        line["threads"] = torch.get_num_threads()
        line["load_avg"] = round(os.getloadavg()[0], 2)
        line["engine_start_s"] = round(load_s, 2)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
