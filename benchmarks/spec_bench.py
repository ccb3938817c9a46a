"""N-gram speculative decoding against plain decoding: decode tok/s, acceptance, same tokens.

Two offline engines (`LLM`) on the default model, one plain and one with
`--speculative-config` (n-gram), generate greedily (stopping at EOS, at most
`--copy-tokens` / `--free-tokens`) on two tasks, through the model's chat
template (what a user of an instruct model sends):

  copy  several "repeat this with one change" prompts: a code block with one
        renamed identifier or method, a docstring added, a paragraph with one
        typo to fix, a list to renumber; the answer copies most of its prompt
  free  short stories: text that does not repeat its prompt

Single-stream: every prompt alone, rounds alternated plain / n-gram per
prompt, reported per prompt and as the median of the per-prompt ratios.
8-stream: 8 requests in one batch (the prompts in turn). The default path is
what a user gets: the GGUF's quantised weights (int4, bf16 activations) on
CPU; `--dtype float32` measures the dequantised float32 path instead (the
first rounds' figures).

Decode tok/s excludes the prefill: the tokens after each request's first,
over the time from the batch's first token to its last (the frontend's
per-request token timestamps; all prompts prefill in one step). Beside it,
decode tokens per CPU second: the in-process engine runs on this thread and
torch on one thread, so this thread's CPU time of a generation, less that of
its prefill steps (each engine step is timed; the steps until every request
had its first token, in the same generation), is the decode's compute
without the time spent waiting for a core that other processes hold (on a
shared machine wall time swings 3-8x with their load; CPU time far less,
though memory bandwidth is still shared). (Before, a separate prefill-only
run's CPU was subtracted: the prefill is ~40% of an 8-stream generation, so
its run-to-run spread moved the decode figure by up to ~20%.) Medians over
`--runs` rounds with min/max, their ratio, the acceptance rate (accepted /
drafted tokens) and the mean accepted length per verification step (1 +
accepted / drafts, the tokens one target forward yields), whether both
engines produced identical tokens (and the fraction of tokens before the
first difference: the quantised path is not batch-invariant, so a forward
over several rows may round differently from one over one row), the dtype
and quantization, the torch thread count and the load average before and
after each case; per position, the fraction of drafts whose position j was
accepted (vLLM's per-position counter over drafts).

Each batched case also replays its plain outputs through
`paged.runner.spec_decode.replay` (no model run, about a second): the
ceilings of speculation on the policy's row-cost curve (every draft accepted;
the proposer's drafts cut to their accepted prefix) and what the `fixed` and
`cost` policies yield by that curve, also on the curve with many-row steps
`--replay-scales` times cheaper. The replay's `cost` figure is the curve's
prediction of `ngram_over_plain_cpu`: the two differ where the curve is off.

Run: .venvs/all/bin/python benchmarks/spec_bench.py [--runs 3 --k 7 --streams 1 8
     --draft-policy cost|fixed --dtype auto|float32 --show]
Prints one JSON line (`--show`: each prompt's generated text to stderr first).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paged.runner.config import ModelConfig
from paged.runner.spec_decode.ngram import NgramProposer
from paged.runner.spec_decode.policy import RowCostModel
from paged.runner.spec_decode.replay import ReplaySequence, ceiling_report, scaled_curve
from paged.scheduler import SamplingParams
from paged.server.chat_utils import apply_chat_template
from paged.server.input_processor import TextPrompt
from paged.server.llm import LLM
from paged.server.outputs import RequestOutput

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
PARAGRAPH = (
    "The lighthouse stood on a rocky point at the edge of the bay. Every evening the keeper "
    "climbed the spiral stairs, trimmed the wick and lit the lamp, and every morning he wrote "
    "the weather in a thick leather book. Ships passing in the night saw the beam sweep acros "
    "the water and knew they were close to home."
)
SHOPPING = "- apples\n- bread\n- milk\n- eggs\n- coffee\n- rice\n- onions\n- butter\n"
# name -> user message. Every one asks for its input back with one change.
COPY_CASES: dict[str, str] = {
    "rename_variable": "Repeat this code exactly, with one change: rename the variable "
    f"`total` to `running_sum`.\n\n{CODE[0]}",
    "rename_method": "Repeat this code exactly, with one change: rename the method `add` "
    f"to `increment`.\n\n{CODE[1]}",
    "add_docstring": f"Repeat this code exactly, with one change: add a docstring.\n\n{CODE[0]}",
    "fix_typo": "Fix the one typo in this paragraph and write the whole paragraph out "
    f"again.\n\n{PARAGRAPH}",
    "renumber_list": "Rewrite this shopping list as a numbered list (1., 2., ...), same "
    f"items, same order.\n\n{SHOPPING}",
}
TOPICS = ("a lighthouse keeper", "a lost violin", "a city under snow", "an old orchard")
FREE_CASES: dict[str, str] = {
    f"story_{i}": f"Write a short story about {topic}." for i, topic in enumerate(TOPICS)
}


def chat_prompt(llm: LLM, message: str) -> TextPrompt:
    """The text prompt `LLM.chat` would send for one user message."""
    text = apply_chat_template(
        llm.get_tokenizer(), [{"role": "user", "content": message}], add_generation_prompt=True
    )
    return {"prompt": text, "add_special_tokens": False}


class StepClock:
    """Wraps the engine's output pull (one engine step in-process): per-step CPU and spec stats.

    The in-process engine runs each step inside `get_output` on this thread, so
    the thread's CPU time across the call is the step's compute (one torch
    thread). `prefill_cpu` is the CPU of the steps up to the one in which the
    last request of the batch got its first token (the prefill: one step for
    these prompts), measured in the same generation as the decode.
    """

    def __init__(self, llm: LLM) -> None:
        self.drafts = self.drafted = self.accepted = 0
        self.accepted_per_pos: list[int] = []
        self.step_cpu: list[tuple[float, set[str]]] = []
        original = llm.engine_client.get_output

        def recording() -> Any:
            c0 = time.thread_time()
            outputs = original()
            cpu = time.thread_time() - c0
            self.step_cpu.append((cpu, {o.request_id for o in outputs.outputs if o.new_token_ids}))
            s = outputs.scheduler_stats
            if s is not None and s.spec_decoding_stats is not None:
                st = s.spec_decoding_stats
                self.drafts += st.num_drafts
                self.drafted += st.num_draft_tokens
                self.accepted += st.num_accepted_tokens
                pos = st.num_accepted_tokens_per_pos
                if len(pos) > len(self.accepted_per_pos):
                    self.accepted_per_pos += [0] * (len(pos) - len(self.accepted_per_pos))
                for j, n in enumerate(pos):
                    self.accepted_per_pos[j] += n
            return outputs

        llm.engine_client.get_output = recording  # type: ignore[method-assign]

    def reset_spec(self) -> None:
        self.drafts = self.drafted = self.accepted = 0
        self.accepted_per_pos = []

    def prefill_cpu(self, num_requests: int) -> float:
        """CPU of the steps until every one of the last generation's requests had a token."""
        seen: set[str] = set()
        cpu = 0.0
        for step, ids in self.step_cpu:
            cpu += step
            seen |= ids
            if len(seen) >= num_requests:
                return cpu
        raise RuntimeError("spec_bench: a request of the batch never got a token")


def decode_rate(
    llm: LLM, clock: StepClock, batch: list[TextPrompt], tokens: int
) -> tuple[float, float, list[RequestOutput]]:
    """Decode tok/s of one batch (wall: tokens after each request's first, first -> last
    token) and this thread's CPU seconds of the generation less its prefill steps."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    clock.step_cpu = []
    cpu0 = time.thread_time()
    outs = llm.generate(list(batch), params, use_tqdm=False)
    cpu = time.thread_time() - cpu0 - clock.prefill_cpu(len(batch))
    first = min(
        o.metrics.first_token_time for o in outs if o.metrics and o.metrics.first_token_time
    )
    last = max(o.metrics.last_token_time for o in outs if o.metrics and o.metrics.last_token_time)
    decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return decoded / max(last - first, 1e-9), cpu, outs


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of tokens before the first difference (1.0: identical outputs)."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same += n
        total += max(len(x), len(y))
    return same / max(total, 1)


@dataclass
class Engines:
    """The plain and the n-gram engine with their step clocks, and what the replay needs."""

    plain: LLM
    spec: LLM
    plain_clock: StepClock
    spec_clock: StepClock
    # Replayed on each batched case's plain outputs (spec_decode/replay.py): name -> curve.
    replay_curves: dict[str, RowCostModel]
    proposer: NgramProposer
    k: int


def run_case(
    engines: Engines, batch: list[TextPrompt], tokens: int, runs: int
) -> tuple[dict[str, Any], list[str]]:
    """Alternated plain / n-gram rounds of one batch; medians, ratio, acceptance, same tokens."""
    load_before = os.getloadavg()
    rates: dict[str, list[float]] = {"plain": [], "ngram": []}
    cpu_rates: dict[str, list[float]] = {"plain": [], "ngram": []}
    same = True
    agree: list[float] = []
    counter = engines.spec_clock
    counter.reset_spec()
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(runs):
        ids: dict[str, list[list[int]]] = {}
        for name, llm, clock in (
            ("plain", engines.plain, engines.plain_clock),
            ("ngram", engines.spec, engines.spec_clock),
        ):
            rate, cpu, outs[name] = decode_rate(llm, clock, batch, tokens)
            ids[name] = [list(o.outputs[0].token_ids) for o in outs[name]]
            decoded = sum(len(x) - 1 for x in ids[name])
            rates[name].append(rate)
            cpu_rates[name].append(decoded / max(cpu, 1e-9))
        same = same and ids["plain"] == ids["ngram"]
        agree.append(agreement(ids["plain"], ids["ngram"]))
    med = {name: statistics.median(r) for name, r in rates.items()}
    med_cpu = {name: statistics.median(r) for name, r in cpu_rates.items()}
    result = {
        **{
            f"{name}_decode_tok_s": {
                "median": round(med[name], 2),
                "min": round(min(r), 2),
                "max": round(max(r), 2),
            }
            for name, r in rates.items()
        },
        "ngram_over_plain": round(med["ngram"] / med["plain"], 3),
        **{
            f"{name}_decode_tok_per_cpu_s": {
                "median": round(med_cpu[name], 2),
                "min": round(min(r), 2),
                "max": round(max(r), 2),
            }
            for name, r in cpu_rates.items()
        },
        "ngram_over_plain_cpu": round(med_cpu["ngram"] / med_cpu["plain"], 3),
        "acceptance_rate": round(counter.accepted / max(counter.drafted, 1), 3),
        "mean_accepted_length": round(1 + counter.accepted / max(counter.drafts, 1), 3),
        "num_drafts": counter.drafts,
        # Per position j: the fraction of drafts whose position j was accepted.
        "accepted_per_pos": [
            round(n / max(counter.drafts, 1), 3) for n in counter.accepted_per_pos
        ],
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs["plain"]),
        "same_tokens": same,
        "prefix_agreement": round(min(agree), 3),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    if len(batch) > 1:
        sequences = [
            ReplaySequence(tuple(o.prompt_token_ids), tuple(o.outputs[0].token_ids), tokens)
            for o in outs["plain"]
        ]
        result["replay"] = {
            name: ceiling_report(curve, sequences, engines.proposer, engines.k)
            for name, curve in engines.replay_curves.items()
        }
    return result, [o.outputs[0].text for o in outs["plain"]]


def task_cases(
    engines: Engines,
    task: str,
    messages: dict[str, str],
    tokens: int,
    args: argparse.Namespace,
    show: Callable[[str, list[str]], None],
) -> dict[str, Any]:
    """Per-prompt single-stream cases with their median, then the batched ones."""
    prompts = {name: chat_prompt(engines.plain, m) for name, m in messages.items()}
    cases: dict[str, Any] = {}
    if 1 in args.streams:
        per_prompt: dict[str, Any] = {}
        for name, prompt in prompts.items():
            per_prompt[name], texts = run_case(engines, [prompt], tokens, args.runs)
            show(f"{task}/{name}", texts)
        ratios = [c["ngram_over_plain"] for c in per_prompt.values()]
        cpu_ratios = [c["ngram_over_plain_cpu"] for c in per_prompt.values()]
        cases[f"{task}_1_stream"] = {
            "median_ngram_over_plain": round(statistics.median(ratios), 3),
            "median_ngram_over_plain_cpu": round(statistics.median(cpu_ratios), 3),
            "median_acceptance_rate": round(
                statistics.median(c["acceptance_rate"] for c in per_prompt.values()), 3
            ),
            "median_mean_accepted_length": round(
                statistics.median(c["mean_accepted_length"] for c in per_prompt.values()), 3
            ),
            "per_prompt": per_prompt,
        }
    names = list(prompts)
    for streams in (s for s in args.streams if s != 1):
        batch = [prompts[names[i % len(names)]] for i in range(streams)]
        cases[f"{task}_{streams}_streams"], texts = run_case(engines, batch, tokens, args.runs)
    return cases


def replay_curves(
    model_config: ModelConfig, row_costs: RowCostModel | None, scales: list[float]
) -> dict[str, RowCostModel]:
    """The spec engine's curve, and that curve with many-row steps `scales` times cheaper."""
    curve = row_costs or RowCostModel.for_path("cpu", model_config.keeps_weights_quantized)
    curves = {"policy_curve": curve}
    for factor in scales:
        curves[f"marginal_{factor}x_cheaper"] = scaled_curve(curve, factor, "marginal")
        curves[f"16_plus_rows_{factor}x_cheaper"] = scaled_curve(curve, factor, "many")
    return curves


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="auto (default: what a user gets; a quantised GGUF on CPU runs int4 weights "
        "with bf16 activations) or float32 (dequantised; batch-invariant, the first rounds' "
        "figures)",
    )
    ap.add_argument("--copy-tokens", type=int, default=160, help="max_tokens, copy prompts")
    ap.add_argument("--free-tokens", type=int, default=128, help="max_tokens, free text")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=3)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tasks", nargs="+", choices=["copy", "free"], default=["copy", "free"])
    ap.add_argument(
        "--draft-policy",
        choices=["cost", "fixed"],
        default="cost",
        help="speculative_config.draft_policy: cost model (default) or every match drafts k",
    )
    ap.add_argument(
        "--row-costs",
        default=None,
        help='speculative_config.row_costs as JSON, e.g. "[[1, 1.0], [8, 2.2], [64, 9.5]]" '
        "(default: the policy's measured curve for the path)",
    )
    ap.add_argument(
        "--replay-scales",
        type=float,
        nargs="*",
        default=[1.5, 2.0],
        help="also replay each batched case on the policy's curve with many-row steps this "
        "many times cheaper (none: only the curve itself)",
    )
    ap.add_argument("--show", action="store_true", help="print each prompt's answer to stderr")
    args = ap.parse_args()
    load_before = os.getloadavg()
    # The path the engines run (the same resolution as theirs; reads no weights).
    model_config = ModelConfig.from_pretrained(args.model, dtype=args.dtype, device="cpu")
    spec_config = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
        "draft_policy": args.draft_policy,
    }
    row_costs = None
    if args.row_costs is not None:
        spec_config["row_costs"] = json.loads(args.row_costs)
        row_costs = RowCostModel.from_pairs(spec_config["row_costs"])
    common: dict[str, Any] = {
        "device": "cpu",
        "dtype": args.dtype,
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 256 << 20,
        "enable_prefix_caching": False,  # rounds alike: no round starts from cached prompts
    }
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config=spec_config, **common)
    engines = Engines(
        plain,
        spec,
        StepClock(plain),
        StepClock(spec),
        replay_curves(model_config, row_costs, args.replay_scales),
        NgramProposer(args.lookup_min, args.lookup_max),
        args.k,
    )

    def show(label: str, texts: list[str]) -> None:
        if args.show:
            print(f"===== {label}\n{texts[0]}\n", file=sys.stderr)

    cases: dict[str, Any] = {}
    try:
        warm = [chat_prompt(plain, "Say hello.")]
        for llm, clock in ((plain, engines.plain_clock), (spec, engines.spec_clock)):
            decode_rate(llm, clock, warm, 4)  # warm-up, not timed
        for task, messages, tokens in (
            ("copy", COPY_CASES, args.copy_tokens),
            ("free", FREE_CASES, args.free_tokens),
        ):
            if task in args.tasks:
                cases.update(task_cases(engines, task, messages, tokens, args, show))
    finally:
        plain.shutdown()
        spec.shutdown()
    print(
        json.dumps(
            {
                "bench": "spec_decode_ngram",
                "model": args.model or "SmolLM2-135M-Instruct (GGUF Q4_1)",
                "device": "cpu",
                "dtype": model_config.dtype_name,
                "quantization": model_config.quantization,
                "speculative_config": spec_config,
                "max_tokens": {"copy": args.copy_tokens, "free": args.free_tokens},
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
