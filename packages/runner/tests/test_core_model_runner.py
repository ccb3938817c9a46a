"""ModelRunner driven by hand-written SchedulerOutputs, checked against HF transformers.

Each test plays the scheduler: random (shuffled) block ids, chunked prefill
mixed with decodes, a request that is unscheduled for a step, preemption with
resume on a fresh block table, finished requests. Greedy tokens must equal
`transformers`' `generate` on the same tiny random checkpoint.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from paged.kvcache import get_kv_cache_config
from paged.runner.config import CacheConfig, ModelConfig, SchedulerLimits
from paged.runner.model_runner import ModelRunner
from paged.scheduler.boundary import (
    CachedRequestData,
    GrammarOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from paged.scheduler.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 64


def hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():  # plain argmax loop: no EOS handling, like the runner
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def make_runner(path: Path, max_num_seqs: int = 4, max_tokens: int = 32) -> ModelRunner:
    config = ModelConfig.from_pretrained(str(path), max_model_len=128)
    runner = ModelRunner(
        config,
        CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 20),
        SchedulerLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens),
        "cpu",
    )
    runner.load_model()
    specs = runner.get_kv_cache_spec()
    kv = get_kv_cache_config(
        specs, runner.determine_available_memory(), num_gpu_blocks_override=NUM_BLOCKS
    )
    runner.initialize_kv_cache(kv)
    return runner


@dataclass
class Req:
    """The test's scheduler-side view of one request."""

    rid: str
    prompt: list[int]
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    output: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    sent: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class ScriptedScheduler:
    """Builds SchedulerOutputs with random block ids from a shuffled free pool."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.free = list(range(1, NUM_BLOCKS))
        self.rng.shuffle(self.free)

    def _grow(self, req: Req, upto: int) -> list[int]:
        need = -(-upto // BLOCK) - len(req.blocks)
        new = [self.free.pop() for _ in range(max(need, 0))]
        req.blocks.extend(new)
        return new

    def release(self, req: Req) -> None:
        self.free.extend(req.blocks)
        self.rng.shuffle(self.free)
        req.blocks = []

    def step(
        self,
        plan: dict[str, int],
        reqs: dict[str, Req],
        finished: list[str] = (),  # type: ignore[assignment]
        preempted: list[str] = (),  # type: ignore[assignment]
        resumed: tuple[str, ...] = (),
    ) -> SchedulerOutput:
        new, cached = [], CachedRequestData()
        c_ids, c_res, c_tok, c_comp, c_out = [], [], [], [], []
        c_blk: list[tuple[list[int], ...] | None] = []
        for rid, n in plan.items():
            req = reqs[rid]
            new_blocks = self._grow(req, req.computed + n)
            if not req.sent:
                new.append(NewRequestData(rid, req.prompt, req.params, (list(req.blocks),), 0))
                req.sent = True
            else:
                is_resumed = rid in resumed
                c_ids.append(rid)
                c_res.append(is_resumed)
                c_tok.append(list(req.output) if is_resumed else [])
                c_blk.append(
                    (list(req.blocks),) if is_resumed else ((new_blocks,) if new_blocks else None)
                )
                c_comp.append(req.computed)
                c_out.append(len(req.output))
        cached = CachedRequestData(c_ids, c_res, c_tok, c_blk, c_comp, c_out)
        so = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(plan),
            total_num_scheduled_tokens=sum(plan.values()),
            finished_req_ids=list(finished),
            preempted_req_ids=list(preempted),
        )
        for rid, n in plan.items():
            reqs[rid].computed += n
        return so


def run_step(runner: ModelRunner, so: SchedulerOutput, reqs: dict[str, Req]) -> ModelRunnerOutput:
    assert runner.execute_model(so) is None
    out = runner.sample_tokens()
    assert out.req_ids == runner.input_batch.req_ids
    for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
        req = reqs[rid]
        if req.computed >= len(req.tokens):
            assert len(toks) == 1
            req.output.extend(toks)
        else:
            assert toks == []  # partial prefill chunk samples nothing
    return out


def test_chunked_prefill_decode_preemption_match_hf(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    runner = make_runner(path)
    sched = ScriptedScheduler(seed=1)
    rng = random.Random(2)
    prompts = {f"r{i}": [rng.randrange(3, 128) for _ in range(n)] for i, n in enumerate([13, 5, 9])}
    reqs = {rid: Req(rid, p) for rid, p in prompts.items()}
    want = {rid: hf_greedy(path, p, 34) for rid, p in prompts.items()}

    run_step(runner, sched.step({"r0": 8, "r1": 5}, reqs), reqs)  # r0 chunk 1, r1 whole prompt
    run_step(runner, sched.step({"r0": 5, "r1": 1, "r2": 4}, reqs), reqs)  # r0 done, r2 chunk
    run_step(runner, sched.step({"r1": 1, "r2": 5}, reqs), reqs)  # r0 unscheduled this step
    for _ in range(10):
        run_step(runner, sched.step({"r0": 1, "r1": 1, "r2": 1}, reqs), reqs)
    # Preempt r1: its blocks are freed, it recomputes from scratch on new blocks.
    sched.release(reqs["r1"])
    reqs["r1"].computed = 0
    run_step(runner, sched.step({"r0": 1, "r2": 1}, reqs, preempted=["r1"]), reqs)
    n1 = len(reqs["r1"].tokens)
    run_step(runner, sched.step({"r0": 1, "r1": n1 - 3, "r2": 1}, reqs, resumed=("r1",)), reqs)
    run_step(runner, sched.step({"r0": 1, "r1": 3, "r2": 1}, reqs), reqs)
    while min(len(r.output) for r in reqs.values()) < 34:
        plan = {rid: 1 for rid, r in reqs.items() if len(r.output) < 34}
        run_step(runner, sched.step(plan, reqs), reqs)
    for rid, req in reqs.items():
        assert req.output[:34] == want[rid], rid
    # Finishing frees the runner's state.
    run_step(runner, sched.step({"r0": 1}, reqs, finished=["r1", "r2"]), reqs)
    assert set(runner.requests) == {"r0"}
    assert runner.input_batch.req_ids == ["r0"]


def test_logprobs_prompt_logprobs_and_seeded_sampling(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("qwen2")
    runner = make_runner(path)
    sched = ScriptedScheduler()
    prompt = [5, 9, 11, 17, 23, 40, 41]
    params = SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=3)
    reqs = {"a": Req("a", prompt, params)}
    out1 = run_step(runner, sched.step({"a": 4}, reqs), reqs)
    out2 = run_step(runner, sched.step({"a": 3}, reqs), reqs)
    # Prompt logprobs: positions 0..5 predict prompt tokens 1..6, split over the two chunks.
    lp1, lp2 = out1.prompt_logprobs["a"], out2.prompt_logprobs["a"]
    assert [row[0] for row in lp1.token_ids + lp2.token_ids] == prompt[1:]
    assert all(len(row) == 4 for row in lp1.token_ids)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    got = [row[0] for row in lp1.logprobs + lp2.logprobs]
    want = [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert got == pytest.approx(want, abs=1e-4)
    assert "a" not in out1.logprobs  # nothing sampled in the first chunk
    sample_lp = out2.logprobs["a"]
    assert sample_lp.token_ids[0][0] == out2.sampled_token_ids[0][0]
    assert sample_lp.ranks == [1]  # greedy token is the most likely one
    assert sample_lp.logprobs[0][0] == pytest.approx(float(ref[-1].max()), abs=1e-4)


def test_seeded_request_reproducible_across_batches(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    seeded = SamplingParams(temperature=1.0, seed=7)

    def generate(extra: int) -> list[int]:
        runner = make_runner(path)
        sched = ScriptedScheduler(seed=extra)
        reqs = {"s": Req("s", [4, 5, 6], seeded)}
        for i in range(extra):
            reqs[f"x{i}"] = Req(f"x{i}", [7 + i, 8], SamplingParams(temperature=1.0))
        run_step(runner, sched.step({rid: len(r.prompt) for rid, r in reqs.items()}, reqs), reqs)
        for _ in range(8):
            run_step(runner, sched.step(dict.fromkeys(reqs, 1), reqs), reqs)
        return reqs["s"].output

    alone = generate(0)
    assert alone == generate(3)
    assert len(set(alone)) > 1


def test_bad_scheduler_output(tiny_checkpoint: Callable[..., Path]) -> None:
    runner = make_runner(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="unknown to the runner"):
        runner.execute_model(
            SchedulerOutput(
                scheduled_cached_reqs=CachedRequestData(["ghost"], [False], [[]], [None], [0], [0]),
                num_scheduled_tokens={"ghost": 1},
                total_num_scheduled_tokens=1,
            )
        )
    new = NewRequestData("a", [1, 2, 3], SamplingParams(), ([1],), 0)
    with pytest.raises(ValueError, match="only 3 tokens are known"):
        runner.execute_model(
            SchedulerOutput(
                scheduled_new_reqs=[new],
                num_scheduled_tokens={"a": 5},
                total_num_scheduled_tokens=5,
            )
        )
    assert runner.sample_tokens() == ModelRunnerOutput()


def test_kv_budget_required_on_cpu(tiny_checkpoint: Callable[..., Path]) -> None:
    config = ModelConfig.from_pretrained(str(tiny_checkpoint("llama")), max_model_len=64)
    runner = ModelRunner(config, CacheConfig(block_size=BLOCK), SchedulerLimits(), "cpu")
    runner.load_model()
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        runner.determine_available_memory()
    with pytest.raises(RuntimeError, match="initialize_kv_cache"):
        runner.execute_model(SchedulerOutput())


class _NaNLogits:
    """Wraps a model so the logits of requests whose last token is 99 are all NaN."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.last_ids: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        self.last_ids = input_ids
        out: torch.Tensor = self.model.forward(input_ids, positions, ctx)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model.compute_logits(hidden)
        logits[0] = float("nan")
        return logits

    def kv_cache_specs(self, block_size: int) -> dict[str, Any]:
        specs: dict[str, Any] = self.model.kv_cache_specs(block_size)
        return specs


def test_nan_logits_reported_per_request(tiny_checkpoint: Callable[..., Path]) -> None:
    runner = make_runner(tiny_checkpoint("llama"))
    runner.model = _NaNLogits(runner.model)
    sched = ScriptedScheduler()
    reqs = {"a": Req("a", [5, 6, 7]), "b": Req("b", [8, 9])}
    out = run_step(runner, sched.step({"a": 3, "b": 2}, reqs), reqs)
    vocab = runner.model_config.vocab_size
    assert out.num_nans_in_logits == {"a": vocab}


def test_grammar_bitmask_restricts_tokens(tiny_checkpoint: Callable[..., Path]) -> None:
    runner = make_runner(tiny_checkpoint("llama"))
    sched = ScriptedScheduler()
    reqs = {"a": Req("a", [5, 6, 7]), "b": Req("b", [8, 9])}
    vocab = runner.model_config.vocab_size
    words = -(-vocab // 32)
    only_17 = [0] * words
    only_17[0] = 1 << 17
    grammar = GrammarOutput(structured_output_request_ids=["b"], grammar_bitmask=[only_17])
    assert runner.execute_model(sched.step({"a": 3, "b": 2}, reqs)) is None
    out = runner.sample_tokens(grammar)
    assert out.sampled_token_ids[out.req_ids.index("b")] == [17]
    bad = GrammarOutput(structured_output_request_ids=["b"], grammar_bitmask=[[1]])
    for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
        reqs[rid].output.extend(toks)
    assert runner.execute_model(sched.step({"a": 1, "b": 1}, reqs)) is None
    with pytest.raises(ValueError, match="bitmask covers 32 tokens"):
        runner.sample_tokens(bad)
