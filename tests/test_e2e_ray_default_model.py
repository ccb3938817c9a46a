"""The default model (SmolLM2-135M: 9 q heads, 3 KV heads) at TP=2 and PP=2 on the Ray executor.

vLLM refuses TP=2 for this model; paged splits the heads unevenly
(packages/runner/src/paged/runner/layers/head_partition.py). In fp32 (GGUF
dequantised, the HF-exact path) the greedy tokens through the whole offline
engine must equal TP=1's, and so must PP=2's (two stages of 15 layers, one
Ray actor each; the multiprocess executor's PP=2 on this model is in
tests/test_pipeline_parallel.py); then a killed Ray actor must fail the in-flight
generate within seconds with WorkerDiedError, and shutdown must leave nothing.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from paged.runner.executor import WorkerDiedError
from paged.runner.executor.ray_distributed import start_local_ray
from paged.scheduler import SamplingParams
from paged.server.llm import LLM

# As RayDistributedExecutor does before importing ray: no `uv run` runtime-env hook.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "List three colours:"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 128,
    "kv_cache_memory_bytes": 64 << 20,
    "max_num_seqs": 4,
}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    start_local_ray(num_cpus=2)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tp1_tokens() -> list[list[int]]:
    """TP=1 x PP=1 greedy tokens: the reference for both layouts below."""
    single = LLM(None, **OPTIONS)
    try:
        return [
            list(o.outputs[0].token_ids) for o in single.generate(PROMPTS, GREEDY, use_tqdm=False)
        ]
    finally:
        single.shutdown()


def _free_cpus_back() -> float:
    deadline = time.monotonic() + 20.0
    while ray.available_resources().get("CPU", 0.0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    return float(ray.available_resources().get("CPU", 0.0))


def test_default_model_pp2_ray_equals_tp1(ray_cluster: None, tp1_tokens: list[list[int]]) -> None:
    """15 + 15 of the 30 layers on two Ray actors, activations over gloo between them."""
    llm = LLM(None, pipeline_parallel_size=2, distributed_executor_backend="ray", **OPTIONS)
    try:
        executor: Any = llm.engine_client.core.model_executor  # type: ignore[attr-defined]
        assert type(executor).__name__ == "RayDistributedExecutor" and len(executor.pids) == 2
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == tp1_tokens
    finally:
        llm.shutdown()
    assert _free_cpus_back() == 2  # the bundles are back


def test_default_model_tp2_ray_equals_tp1_then_actor_death_fails_fast(
    ray_cluster: None, tp1_tokens: list[list[int]]
) -> None:
    want = tp1_tokens
    llm = LLM(None, tensor_parallel_size=2, distributed_executor_backend="ray", **OPTIONS)
    executor: Any = llm.engine_client.core.model_executor  # type: ignore[attr-defined]
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == want
        # An in-flight generate when rank 1's actor is killed.
        raised: list[BaseException] = []
        finished_at: list[float] = []

        def run() -> None:
            long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
            try:
                llm.generate(PROMPTS, long, use_tqdm=False)
            except BaseException as exc:  # the test inspects it
                raised.append(exc)
            finished_at.append(time.monotonic())

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(1.0)  # let it get going
        killed_at = time.monotonic()
        os.kill(executor.pids[1], signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive(), "generate hung after the actor died"
        assert finished_at[0] - killed_at < 15.0
        assert len(raised) == 1 and isinstance(raised[0], WorkerDiedError), raised
        assert "worker 1 (Ray actor" in str(raised[0])
    finally:
        llm.shutdown()
    assert _free_cpus_back() == 2  # the bundles are back
