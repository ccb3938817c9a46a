"""Simulation helpers: a Scheduler over a real KVCacheManager and a deterministic fake runner.

Used by this package's tests and usable by any engine test that needs a
scheduler without a model. The fake runner keeps its own copy of each request
from the `SchedulerOutput` diffs alone (as a real runner must), checks that
every computed position has a slot, and samples a token that depends only on
the sequence so far, so runs with and without preemption must agree.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paged.kvcache import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from paged.multimodal.inputs import MultiModalFeatureSpec
from paged.scheduler.boundary import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    PoolerOutput,
    SchedulerOutput,
)
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4


def kv_config(num_blocks: int, block_size: int = BLOCK_SIZE) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float32")
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
    )


def make_scheduler(num_blocks: int = 64, *, max_model_len: int = 256, **kwargs: Any) -> Scheduler:
    sched_keys = {
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_chunked_prefill",
        "long_prefill_token_threshold",
        "long_prefill_token_threshold_adaptive",
        "policy",
        "max_logprobs",
        "disable_chunked_mm_input",
        "max_num_encoder_input_tokens",
        "encoder_cache_size",
        "num_lookahead_tokens",
        "kv_load_failure_policy",
        "pipeline_parallel_size",
        "max_loras",
    }
    limits = {k: v for k, v in kwargs.items() if k in sched_keys}
    if "max_num_seqs" not in limits:
        # SchedulerConfig's default (256), capped by the token budget as vLLM requires
        # (max_num_batched_tokens >= max_num_seqs), so small-budget tests stay valid.
        limits["max_num_seqs"] = min(256, limits.get("max_num_batched_tokens", 2048))
    config = SchedulerConfig(max_model_len=max_model_len, **limits)
    rest = {k: v for k, v in kwargs.items() if k not in sched_keys}
    rest.setdefault("hash_seed", 0)
    return Scheduler(config, kv_config(num_blocks), BLOCK_SIZE, **rest)


def make_request(
    rid: str,
    prompt: list[int] | int,
    *,
    max_tokens: int | None = 8,
    eos: int | None = None,
    priority: int = 0,
    arrival: float = 0.0,
    client: int = 0,
    mm: list[MultiModalFeatureSpec] | None = None,
    **params: Any,
) -> EngineCoreRequest:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos,
        arrival_time=arrival,
        priority=priority,
        client_index=client,
        mm_features=mm,
    )


def next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the sequence."""
    return (sum(tokens[-4:]) * 7 + len(tokens)) % 97 + 3


@dataclass
class RunnerRequest:
    tokens: list[int]
    num_computed: int
    block_ids: list[list[int]]
    prompt_len: int


@dataclass
class FakeRunner:
    """Mirrors request state from SchedulerOutput diffs; samples with `next_token`."""

    block_size: int = BLOCK_SIZE
    sample: Callable[[list[int]], int] = next_token
    reqs: dict[str, RunnerRequest] = field(default_factory=dict)
    # Extra per-call behaviour for tests (NaNs, connector outputs...).
    extra: dict[str, Any] = field(default_factory=dict)
    # Pooling requests (NewRequestData.pooling_params set): pooled, never sampled.
    pooling: set[str] = field(default_factory=set)
    # Prompt positions each pooling request computed, in order (chunking checks).
    pooled_positions: dict[str, list[int]] = field(default_factory=dict)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = RunnerRequest(
                list(new.prompt_token_ids),
                new.num_computed_tokens,
                [list(g) for g in new.block_ids],
                len(new.prompt_token_ids),
            )
            if new.pooling_params is not None:
                self.pooling.add(new.req_id)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.reqs[rid]
            ids = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                # Resumed: the block table is replaced and the outputs resent.
                assert ids is not None
                state.block_ids = [list(g) for g in ids]
                state.tokens = state.tokens[: state.prompt_len] + list(cached.new_token_ids[i])
            else:
                # A running request's progress must match the runner's own count.
                assert state.num_computed == cached.num_computed_tokens[i], rid
                if ids is not None:
                    for group, extra in zip(state.block_ids, ids, strict=True):
                        group.extend(extra)
            state.num_computed = cached.num_computed_tokens[i]
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        pooled: dict[str, PoolerOutput] = {}
        for rid, n in so.num_scheduled_tokens.items():
            state = self.reqs[rid]
            start = state.num_computed
            state.num_computed += n
            # Every computed position needs a slot.
            assert len(state.block_ids[0]) * self.block_size >= state.num_computed, rid
            req_ids.append(rid)
            if rid in self.pooling:
                self.pooled_positions.setdefault(rid, []).extend(range(start, state.num_computed))
                sampled.append([])
                if state.num_computed >= len(state.tokens):
                    # "Embedding": the prompt's token sum, one float32.
                    value = struct.pack("<f", float(sum(state.tokens)))
                    pooled[rid] = PoolerOutput(data=value, shape=[1])
            elif state.num_computed >= len(state.tokens):
                token = self.sample(state.tokens)
                state.tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        if pooled:
            return ModelRunnerOutput(
                req_ids=req_ids, sampled_token_ids=sampled, pooler_output=pooled, **self.extra
            )
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **self.extra)


def run_to_completion(
    sched: Scheduler,
    runner: FakeRunner | None = None,
    max_steps: int = 10_000,
    on_step: Callable[[Scheduler, SchedulerOutput], None] | None = None,
) -> dict[str, list[EngineCoreOutput]]:
    """Step until idle; returns every EngineCoreOutput per request id."""
    runner = runner or FakeRunner()
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not sched.has_requests():
            return outputs
        so = sched.schedule()
        if on_step is not None:
            on_step(sched, so)
        mro = runner.execute(so)
        for eco in sched.update_from_output(so, mro).values():
            for out in eco.outputs:
                outputs.setdefault(out.request_id, []).append(out)
        sched.check_integrity()
    raise AssertionError("scheduler did not go idle")


def tokens_of(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def free_blocks(sched: Scheduler) -> int:
    return sched.state.kv.block_pool.get_num_free_blocks()


def all_outputs(results: dict[int, EngineCoreOutputs]) -> list[EngineCoreOutput]:
    return [o for eco in results.values() for o in eco.outputs]
