"""RayDistributedExecutor on a local 2-CPU Ray cluster (gloo): TP=2 equals TP=1, deaths, shutdown.

One cluster for the module (starting Ray costs seconds); the test checks
that its executor left no actor and no placement group behind. The head
counts need paged's uneven head partition (layers/head_partition.py; the
replicated and uneven layouts are checked layer by layer, cheaply, in
test_layers_head_partition_math.py).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from paged.runner.config import (
    CacheConfig,
    EngineConfig,
    ExecutorBackend,
    ModelConfig,
    ParallelConfig,
    SchedulerLimits,
)
from paged.runner.executor import (
    UniProcExecutor,
    WorkerDiedError,
    WorkerError,
    create_executor,
)
from paged.runner.executor.messages import (
    CheckHealth,
    GetKVCacheSpec,
    InitializeFromConfig,
    KVCacheConfigWire,
)

# As RayDistributedExecutor does before importing ray: no `uv run` runtime-env hook.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
ray = pytest.importorskip("ray")

from paged.runner.executor.ray_distributed import (  # noqa: E402
    RayDistributedExecutor,
    start_local_ray,
)

BLOCK = 4
GreedyDriver = Callable[..., dict[str, list[int]]]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    start_local_ray(num_cpus=2)
    try:
        yield
    finally:
        ray.shutdown()


def config(path: Path, tp: int, backend: ExecutorBackend) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig.from_pretrained(str(path), max_model_len=64),
        cache_config=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 20),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, distributed_executor_backend=backend
        ),
        scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=32),
    )


def assert_nothing_left(executor: RayDistributedExecutor) -> None:
    """Actors gone (their processes too), bundles returned to the cluster."""
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        alive = [pid for pid in executor.pids if _alive(pid)]
        freed = ray.available_resources().get("CPU", 0.0) == ray.cluster_resources()["CPU"]
        if not alive and freed:
            return
        time.sleep(0.2)
    raise AssertionError(f"left behind: pids {alive}, resources {ray.available_resources()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent, the raylet, reaps it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_tp2_ray_matches_tp1_then_errors_death_and_shutdown(
    ray_cluster: None, tiny_checkpoint: Callable[..., Path], executor_greedy: GreedyDriver
) -> None:
    # 6 q heads over 3 KV heads at TP=2: uneven (rank 0: q 0-3 / kv 0-1, rank 1:
    # q 4-5 / kv 2); vLLM refuses this size. One executor for every check: each
    # start spawns two Ray worker processes that import torch (~20-30 s here).
    path = tiny_checkpoint(
        "llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16
    )
    prompts = {"a": [5, 6, 7, 8, 9], "b": [40, 41, 42]}
    with UniProcExecutor(config(path, 1, "uni")) as uni:
        want = executor_greedy(uni, prompts, 10)
    executor = create_executor(config(path, 2, "ray"))
    assert isinstance(executor, RayDistributedExecutor)
    try:
        assert executor_greedy(executor, prompts, 10) == want
        # collective_rpc answers in rank order; each rank's KV spec follows its own heads.
        specs = executor.collective_rpc(GetKVCacheSpec())
        assert [{s.num_kv_heads for s in rank.values()} for rank in specs] == [{2}, {1}]
        assert executor.collective_rpc(CheckHealth()) == [None, None]
        assert len(set(executor.pids)) == 2 and os.getpid() not in executor.pids
        # A worker's exception comes back with its traceback; the actors survive it.
        empty = InitializeFromConfig(KVCacheConfigWire(num_blocks=4, tensors=[], groups=[]))
        with pytest.raises(WorkerError, match=r"worker 0: (?s:.*)kv_cache_groups must not be"):
            executor.collective_rpc(empty)
        executor.check_health()
        # Kill rank 1's process: the next call fails within seconds, naming it.
        os.kill(executor.pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker 1 \(Ray actor, pid \d+\) died"):
            executor.collective_rpc(CheckHealth(), timeout=60)
        assert time.monotonic() - start < 10.0
        start = time.monotonic()
        with pytest.raises(WorkerDiedError):  # and keeps failing fast
            executor.check_health()
        assert time.monotonic() - start < 0.5
    finally:
        executor.shutdown()
    assert_nothing_left(executor)
    executor.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        executor.check_health()
