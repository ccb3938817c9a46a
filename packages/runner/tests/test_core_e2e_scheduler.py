"""The real Scheduler + KVCacheManager driving the runner (through an executor) vs transformers.

A small KV budget forces preemption and resume; a small token budget forces
chunked prefill mixed with decodes; finishing requests in varying order
shuffles the block ids later requests get. Greedy tokens must equal HF's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from paged.kvcache import get_kv_cache_config
from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits
from paged.runner.executor import Executor, UniProcExecutor
from paged.scheduler.boundary import EngineCoreRequest, SchedulerOutput
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.scheduler import Scheduler

BLOCK = 4
MAX_LEN = 128


def engine_config(path: Path, max_num_seqs: int, max_num_batched_tokens: int) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig.from_pretrained(str(path), max_model_len=MAX_LEN),
        cache_config=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 20),
        scheduler_limits=SchedulerLimits(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
    )


def generate(
    executor: Executor,
    prompts: dict[str, list[int]],
    n: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> tuple[dict[str, list[int]], list[SchedulerOutput]]:
    """Run the engine loop until every request has `n` tokens."""
    kv = get_kv_cache_config(
        executor.get_kv_cache_specs(),
        executor.determine_available_memory(),
        num_gpu_blocks_override=num_blocks,
    )
    executor.initialize_from_config(kv)
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=MAX_LEN,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        ),
        kv,
        BLOCK,
    )
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, (rid, prompt) in enumerate(prompts.items()):
        scheduler.add_request(EngineCoreRequest(rid, prompt, params, None, float(i)))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    steps: list[SchedulerOutput] = []
    while scheduler.has_requests():
        so = scheduler.schedule()
        steps.append(so)
        out = executor.execute_model(so)
        if out is None:
            out = executor.sample_tokens(None)
        for outputs in scheduler.update_from_output(so, out).values():
            for o in outputs.outputs:
                tokens[o.request_id].extend(o.new_token_ids)
        assert len(steps) < 2000
    return tokens, steps


def hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def prompts_for(seed: int, lengths: list[int]) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(3, 128) for _ in range(n)] for i, n in enumerate(lengths)}


@pytest.mark.slow
def test_scheduler_runner_matches_hf_with_preemption(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    prompts = prompts_for(0, [21, 6, 14, 9])
    n = 34
    with UniProcExecutor(engine_config(path, max_num_seqs=4, max_num_batched_tokens=16)) as ex:
        tokens, steps = generate(
            ex, prompts, n, num_blocks=30, max_num_seqs=4, max_num_batched_tokens=16
        )
    assert any(so.preempted_req_ids for so in steps), "the KV budget should force preemption"
    assert any(
        so.scheduled_cached_reqs.resumed_from_preemption
        and any(so.scheduled_cached_reqs.resumed_from_preemption)
        for so in steps
    )
    # Some step mixes a prefill chunk with decodes.
    assert any(
        len(so.num_scheduled_tokens) > 1
        and max(so.num_scheduled_tokens.values()) > 1
        and min(so.num_scheduled_tokens.values()) == 1
        for so in steps
    )
    for rid, prompt in prompts.items():
        assert tokens[rid] == hf_greedy(path, prompt, n), rid


@pytest.mark.slow
def test_prefix_cache_hits_match_hf(tiny_checkpoint: Callable[..., Path]) -> None:
    """Requests sharing a prompt prefix start from cached blocks (num_computed_tokens > 0)."""
    path = tiny_checkpoint("qwen2")
    rng = random.Random(5)
    prefix = [rng.randrange(3, 128) for _ in range(17)]
    prompts = {f"p{i}": prefix + [rng.randrange(3, 128) for _ in range(i + 2)] for i in range(3)}
    n = 8
    with UniProcExecutor(engine_config(path, max_num_seqs=4, max_num_batched_tokens=24)) as ex:
        tokens, steps = generate(
            ex, prompts, n, num_blocks=60, max_num_seqs=4, max_num_batched_tokens=24
        )
    hits = [r.num_computed_tokens for so in steps for r in so.scheduled_new_reqs]
    assert max(hits) >= 16, hits
    for rid, prompt in prompts.items():
        assert tokens[rid] == hf_greedy(path, prompt, n), rid


@pytest.mark.slow
def test_hybrid_sliding_and_full_layers_match_hf(tiny_checkpoint: Callable[..., Path]) -> None:
    """Qwen2 with a sliding-window layer and a full one: two KV cache groups, two block tables."""
    path = tiny_checkpoint("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    prompts = prompts_for(3, [19, 5, 12])
    n = 34
    with UniProcExecutor(engine_config(path, max_num_seqs=3, max_num_batched_tokens=16)) as ex:
        specs = ex.get_kv_cache_specs()
        assert {type(s).__name__ for s in specs.values()} == {
            "FullAttentionSpec",
            "SlidingWindowSpec",
        }
        tokens, steps = generate(
            ex, prompts, n, num_blocks=40, max_num_seqs=3, max_num_batched_tokens=16
        )
    groups = {len(r.block_ids) for so in steps for r in so.scheduled_new_reqs}
    assert groups == {2}, groups
    for rid, prompt in prompts.items():
        assert tokens[rid] == hf_greedy(path, prompt, n), rid
