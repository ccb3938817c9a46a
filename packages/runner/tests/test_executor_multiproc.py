"""MultiprocExecutor: TP=2 on CPU (gloo) gives TP=1's greedy tokens; a dead worker is an error."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from paged.runner.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerLimits,
)
from paged.runner.executor import (
    MultiprocExecutor,
    UniProcExecutor,
    WorkerDiedError,
    WorkerError,
    create_executor,
)
from paged.runner.executor.messages import CheckHealth

BLOCK = 4


def config(path: Path, tp: int) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig.from_pretrained(str(path), max_model_len=64),
        cache_config=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 20),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="mp"),
        scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=32),
    )


@pytest.mark.slow
def test_tp2_matches_tp1_and_dead_worker_raises(
    tiny_checkpoint: Callable[..., Path], executor_greedy: Callable[..., dict[str, list[int]]]
) -> None:
    path = tiny_checkpoint("llama")
    prompts = {"a": [5, 6, 7, 8, 9], "b": [40, 41, 42]}
    with UniProcExecutor(replace(config(path, 1), parallel_config=ParallelConfig())) as uni:
        want = executor_greedy(uni, prompts, 12)
    executor = MultiprocExecutor(config(path, 2))
    try:
        assert executor_greedy(executor, prompts, 12) == want
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
    executor = create_executor(cfg)
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
