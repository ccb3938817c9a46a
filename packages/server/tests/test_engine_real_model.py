"""The real EngineCore on a tiny random Llama checkpoint: tokens equal HF greedy.

The checkpoint is built in the test (transformers LlamaConfig + save_pretrained);
no download. The multiprocess tests spawn the engine and load the model in
the child, so they are marked slow.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits
from paged.scheduler.boundary import EngineCoreOutput, EngineCoreRequest, FinishReason
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.client import AsyncMPClient, SyncMPClient
from paged.server.engine.core import EngineCore, make_engine_core_factory
from paged.server.engine.errors import EngineDeadError, EngineStartupError

VOCAB = 96
PROMPTS = {"p0": [1, 5, 9, 13, 2], "p1": [7] * 11, "p2": list(range(3, 40))}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread here and in spawned engines: the model is tiny, and on a
    shared machine OpenMP threads spinning against other load slow steps ~100x."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


def engine_config(path: Path, **limits: Any) -> EngineConfig:
    model = ModelConfig.from_pretrained(str(path), dtype="float32", max_model_len=96)
    return EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 16),
        scheduler_limits=SchedulerLimits(
            max_num_seqs=4, max_num_batched_tokens=limits.get("max_num_batched_tokens", 16)
        ),
    )


def hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)  # eval mode
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def greedy(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=2,
        arrival_time=time.time(),
    )


def run(core: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    got: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(500):
        if not core.has_work():
            return got
        for outputs in core.run_step().values():
            for out in outputs.outputs:
                got.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not go idle")


@pytest.mark.parametrize("batch_queue_size", [1, 2])
def test_real_engine_core_matches_hf_greedy(tiny_llama: Path, batch_queue_size: int) -> None:
    core = EngineCore(engine_config(tiny_llama), batch_queue_size=batch_queue_size)
    try:
        assert core.info.num_gpu_blocks > 8
        for rid, prompt in PROMPTS.items():
            core.add_request(greedy(rid, prompt, 6))
        got = run(core)
        for rid, prompt in PROMPTS.items():
            tokens = [t for o in got[rid] for t in o.new_token_ids]
            assert tokens == hf_greedy(tiny_llama, prompt, 6), rid
            assert got[rid][-1].finish_reason is FinishReason.LENGTH
        stats = core.get_stats()
        assert stats.scheduler is not None and stats.scheduler.kv_cache_usage == 0.0
        assert core.is_healthy()
    finally:
        core.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_real_engine_process_serves_then_dies_loudly(tiny_llama: Path) -> None:
    client = AsyncMPClient(make_engine_core_factory(engine_config(tiny_llama)))
    try:
        await client.add_request_async(greedy("a", PROMPTS["p0"], 4))
        tokens: list[int] = []
        finished = False
        while not finished:
            batch = await asyncio.wait_for(client.get_output_async(), 120)
            for out in batch.outputs:
                tokens += out.new_token_ids
                finished = finished or out.finished
        assert tokens == hf_greedy(tiny_llama, PROMPTS["p0"], 4)

        # A long request keeps the engine busy; then the process is killed.
        await client.add_request_async(greedy("long", PROMPTS["p1"], 80))
        await asyncio.wait_for(client.get_output_async(), 120)
        pending = asyncio.ensure_future(client.get_output_async())
        pid = client.engine_pid
        assert pid is not None
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died unexpectedly"):
            while True:  # outputs sent before the kill may still be queued
                await asyncio.wait_for(pending, 10)
                pending = asyncio.ensure_future(client.get_output_async())
        assert time.monotonic() - killed_at < 10
        with pytest.raises(EngineDeadError):
            await client.add_request_async(greedy("after", [1, 2], 2))
    finally:
        client.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_corrupt_checkpoint_is_one_startup_error(tiny_llama: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    config = engine_config(broken)  # the frontend only reads config.json
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match="engine core failed to start") as info:
        SyncMPClient(make_engine_core_factory(config))
    assert "safetensors" in str(info.value).lower() or "header" in str(info.value).lower()
    assert info.value.engine_traceback is not None
    assert time.monotonic() - start < 300
