"""CUDA-graph decode: capture sizes on any machine; eager == graph greedy tokens on a GPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from paged.kvcache import get_kv_cache_config
from paged.runner.config import CacheConfig, ModelConfig, SchedulerLimits
from paged.runner.cuda_graphs import CudaGraphRunner, default_capture_sizes
from paged.runner.model_runner import ModelRunner
from paged.scheduler.boundary import CachedRequestData, NewRequestData, SchedulerOutput
from paged.scheduler.sampling_params import SamplingParams


def test_default_capture_sizes() -> None:
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert default_capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]


def test_graph_runner_needs_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        CudaGraphRunner(None, [], 4, 4, 64, torch.device("cpu"))  # type: ignore[arg-type]


def _greedy(path: Path, enforce_eager: bool, steps: int = 12) -> list[list[int]]:
    config = ModelConfig.from_pretrained(
        str(path), dtype="float32", max_model_len=64, device="cuda", enforce_eager=enforce_eager
    )
    runner = ModelRunner(
        config,
        CacheConfig(block_size=4, gpu_memory_utilization=0.3),
        SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64),
        "cuda",
    )
    runner.load_model()
    kv = get_kv_cache_config(
        runner.get_kv_cache_spec(), runner.determine_available_memory(), num_gpu_blocks_override=64
    )
    runner.initialize_kv_cache(kv)
    assert (runner.cuda_graphs is None) == enforce_eager
    prompts = {"a": [5, 6, 7, 8, 9], "b": [40, 41], "c": [3, 4, 5]}
    params = SamplingParams(temperature=0.0)
    blocks = {r: list(range(1 + 16 * i, 17 + 16 * i)) for i, r in enumerate(prompts)}
    so = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(r, p, params, (blocks[r],), 0) for r, p in prompts.items()
        ],
        num_scheduled_tokens={r: len(p) for r, p in prompts.items()},
        total_num_scheduled_tokens=sum(len(p) for p in prompts.values()),
    )
    out: dict[str, list[int]] = {r: [] for r in prompts}
    for _ in range(steps):
        assert runner.execute_model(so) is None
        result = runner.sample_tokens()
        for r, toks in zip(result.req_ids, result.sampled_token_ids, strict=True):
            out[r].extend(toks)
        ids = list(prompts)
        so = SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(
                ids,
                [False] * 3,
                [[], [], []],
                [None] * 3,
                [len(prompts[r]) + len(out[r]) - 1 for r in ids],
                [len(out[r]) for r in ids],
            ),
            num_scheduled_tokens=dict.fromkeys(ids, 1),
            total_num_scheduled_tokens=3,
        )
    return [out[r] for r in prompts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_decode_matches_eager(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    assert _greedy(path, enforce_eager=False) == _greedy(path, enforce_eager=True)
