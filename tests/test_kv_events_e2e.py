"""KV cache events end to end: the real engine on a tiny random Llama publishes,
and `examples/kv_events_subscriber.py`, started after the workload, rebuilds
the pool's cached blocks from replayed events alone. The example also follows
a publisher in the legacy "array" layout when told so, and says when not.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from paged.connectors.events import (
    CachedBlockIndex,
    KVEventsConfig,
    KVEventSubscriber,
    ZmqEventPublisher,
    external_block_hash,
)
from paged.kvcache.events import BlockRemoved, BlockStored
from paged.kvcache.ids import get_block_hash, get_group_id
from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.core import EngineCore

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kv_events_subscriber.py"
VOCAB = 96


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
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def pool_blocks(core: EngineCore) -> Counter[tuple[str, int | None, int | bytes]]:
    scheduler: Any = core.scheduler
    return Counter(
        ("GPU", get_group_id(key), external_block_hash(get_block_hash(key)))
        for key, _ in scheduler.state.kv.block_pool.cached_block_hash_to_block.items()
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_example_subscriber_joins_late_and_matches_the_pool(
    tiny_llama: Path, tmp_path: Path
) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv-events",
    )
    config = EngineConfig(
        model_config=ModelConfig.from_pretrained(
            str(tiny_llama), dtype="float32", max_model_len=96
        ),
        cache_config=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 15),
        scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=32),
    )
    core = EngineCore(config, kv_events_config=cfg)
    live = KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint, topic=cfg.topic)
    try:
        rng = random.Random(7)
        prefixes = [
            [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 16))] for _ in range(3)
        ]
        for i in range(24):
            prompt = rng.choice(prefixes) + [
                rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 20))
            ]
            params = SamplingParams(
                temperature=0.0, max_tokens=rng.randrange(1, 5), ignore_eos=True
            )
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params, None, time.time()))
            if i % 3 == 0:
                core.run_step()
        while core.has_work():
            core.run_step()
        publisher = core.event_publisher
        assert isinstance(publisher, ZmqEventPublisher) and publisher.next_seq > 3
        expected = pool_blocks(core)
        assert expected

        # The in-process subscriber, connected from the start.
        index = CachedBlockIndex()
        removed = 0
        deadline = time.monotonic() + 60
        while live.next_seq < publisher.next_seq and time.monotonic() < deadline:
            for _, batch in live.poll(100):
                index.apply(batch)
                removed += sum(type(e).__name__ == "BlockRemoved" for e in batch.events)
        assert removed > 0  # the workload evicted cached blocks
        assert Counter({(m, g, h): n for (m, g, h), n in index.blocks.items()}) == expected

        # The shipped example, started only now: everything comes by replay.
        out = subprocess.run(
            [sys.executable, str(EXAMPLE), "--endpoint", cfg.endpoint, "--replay-endpoint",
             str(cfg.replay_endpoint), "--topic", cfg.topic, "--until-seq",
             str(publisher.next_seq), "--timeout", "60", "--summary"],
            capture_output=True, text=True, timeout=300, check=True,
        ).stdout  # fmt: skip
        lines = out.strip().splitlines()
        summary = json.loads(lines[-1])
        assert summary["next_seq"] == publisher.next_seq and summary["lost"] == 0
        assert len(lines) == publisher.next_seq + 1  # one line per batch, then the summary
        got = Counter({(m, g, h): n for m, g, h, n in summary["blocks"]})
        assert got == expected
    finally:
        live.close()
        core.shutdown()
        torch.set_num_threads(previous)


def _run_example(cfg: KVEventsConfig, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--endpoint", cfg.endpoint, "--replay-endpoint",
         str(cfg.replay_endpoint), "--timeout", "60", "--quiet", "--summary", *extra],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_example_subscriber_follows_the_array_layout_when_told(tmp_path: Path) -> None:
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        wire_format="array",
    )
    h = [i.to_bytes(32, "big") for i in range(4)]
    publisher = ZmqEventPublisher(cfg)
    try:
        publisher.publish([BlockStored(h[1:4], h[0], [0] * 12, 4, group_idx=0)])  # type: ignore[arg-type]
        publisher.publish([BlockRemoved([h[2]], group_idx=0)])  # type: ignore[list-item]
        out = _run_example(cfg, "--wire-format", "array", "--until-seq", "2")
        assert out.returncode == 0, out.stderr
        summary = json.loads(out.stdout.strip().splitlines()[-1])
        assert summary["next_seq"] == 2 and summary["lost"] == 0
        assert summary["blocks"] == [["GPU", 0, 1, 1], ["GPU", 0, 3, 1]]

        wrong = _run_example(cfg, "--until-seq", "2")  # --wire-format map, the default
        assert wrong.returncode == 1
        assert "not a batch in the 'map' wire layout" in wrong.stderr
    finally:
        publisher.shutdown()
