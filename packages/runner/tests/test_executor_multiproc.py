"""MultiprocExecutor: TP=2 on CPU (gloo) gives TP=1's greedy tokens; a dead worker is an error."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from paged.kvcache import get_kv_cache_config
from paged.runner.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerLimits,
)
from paged.runner.executor import (
    Executor,
    MultiprocExecutor,
    UniProcExecutor,
    WorkerDiedError,
    WorkerError,
)
from paged.runner.executor.messages import CheckHealth
from paged.scheduler.boundary import NewRequestData, SchedulerOutput
from paged.scheduler.sampling_params import SamplingParams

BLOCK = 4


def config(path: Path, tp: int) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig.from_pretrained(str(path), max_model_len=64),
        cache_config=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 20),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="mp"),
        scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=32),
    )


def greedy(executor: Executor, prompts: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
    kv = get_kv_cache_config(
        executor.get_kv_cache_specs(),
        executor.determine_available_memory(),
        num_gpu_blocks_override=64,
    )
    executor.initialize_from_config(kv)
    from paged.scheduler.boundary import CachedRequestData

    params = SamplingParams(temperature=0.0)
    blocks = {rid: list(range(1 + 16 * i, 1 + 16 * (i + 1))) for i, rid in enumerate(prompts)}
    new = [NewRequestData(rid, p, params, (blocks[rid],), 0) for rid, p in prompts.items()]
    so = SchedulerOutput(
        scheduled_new_reqs=new,
        num_scheduled_tokens={rid: len(p) for rid, p in prompts.items()},
        total_num_scheduled_tokens=sum(len(p) for p in prompts.values()),
    )
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(steps):
        assert executor.execute_model(so) is None
        result = executor.sample_tokens(None)
        for rid, toks in zip(result.req_ids, result.sampled_token_ids, strict=True):
            out[rid].extend(toks)
        ids = list(prompts)
        so = SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(
                ids,
                [False] * len(ids),
                [[] for _ in ids],
                [None] * len(ids),
                [len(prompts[r]) + len(out[r]) - 1 for r in ids],
                [len(out[r]) for r in ids],
            ),
            num_scheduled_tokens=dict.fromkeys(ids, 1),
            total_num_scheduled_tokens=len(ids),
        )
    return out


@pytest.mark.slow
def test_tp2_matches_tp1_and_dead_worker_raises(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    prompts = {"a": [5, 6, 7, 8, 9], "b": [40, 41, 42]}
    with UniProcExecutor(replace(config(path, 1), parallel_config=ParallelConfig())) as uni:
        want = greedy(uni, prompts, 12)
    executor = MultiprocExecutor(config(path, 2))
    try:
        assert greedy(executor, prompts, 12) == want
        executor.check_health()
        victim = executor.procs[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"worker 1 \(pid \d+\) died"):
            executor.collective_rpc(CheckHealth(), timeout=60)
        with pytest.raises(WorkerDiedError):  # and keeps failing fast
            executor.check_health()
    finally:
        executor.shutdown()
    assert all(not p.is_alive() for p in executor.procs)


@pytest.mark.slow
def test_worker_errors_surface_and_shutdown_is_clean(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    cfg = replace(config(path, 1), cache_config=CacheConfig(block_size=BLOCK))  # no CPU budget
    executor = Executor.create(cfg)
    assert isinstance(executor, MultiprocExecutor)
    try:
        executor.check_health()
        assert set(executor.get_kv_cache_specs()) == {
            "model.layers.0.self_attn.attn",
            "model.layers.1.self_attn.attn",
        }
        with pytest.raises(WorkerError, match="kv_cache_memory_bytes: required on CPU"):
            executor.determine_available_memory()
        executor.check_health()  # the worker survived its error
    finally:
        executor.shutdown()
    assert [p.exitcode for p in executor.procs] == [0]
    executor.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        executor.check_health()
