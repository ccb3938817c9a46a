"""KV cache events end to end: the real engine on a tiny random Llama publishes,
and `examples/kv_events_subscriber.py`, started after the workload, rebuilds
the pool's cached blocks from replayed events alone. Every payload the engine
published is also decoded by a decoder declared from vLLM 0.33.0's own class
definitions (below), read through a raw zmq DEALER as vLLM's clients do. The
example also follows a publisher in the legacy "array" layout when told so,
and says when not.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq

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


# ---- vLLM 0.33.0's definitions, written from vllm-0.33.0/vllm/distributed/kv_events.py
# (not imported from paged; the same mirror as packages/connectors/tests/test_events_vllm033.py,
# kept here because each test tree runs on its own).
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # :31-39
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # :42-48
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):  # :56-98
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):  # :123-130
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):  # :144-145
    pass


class VllmKVEventBatch(VllmEventBatch):  # :148-149
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


def _vllm_chain(parent: int | bytes | None, token_ids: list[int], block_size: int) -> list[int]:
    """vLLM 0.33.0's sha256 block hashes of `token_ids`, as its events carry them (ints).

    vllm/utils/hashing.py sha256 (SHA-256 of pickle protocol 5), kv_cache_utils.py
    hash_block_tokens / init_none_hash (seed PYTHONHASHSEED, else "vllm-none-hash")
    and maybe_convert_block_hash (low 64 bits, big-endian). Only a chain that starts
    at the root (parent None) can be recomputed from the event alone.
    """
    assert parent is None

    def h(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    prev = h(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))
    out = []
    for i in range(0, len(token_ids), block_size):
        prev = h((prev, tuple(token_ids[i : i + block_size]), None))
        out.append(int.from_bytes(prev, "big") & ((1 << 64) - 1))
    return out


def _replay_as_vllm_client(endpoint: str, topic: str) -> list[tuple[int, VllmKVEventBatch]]:
    """Every batch the replay ring holds, through a raw DEALER, decoded by vLLM's structs.

    vLLM 0.33.0's reply (kv_events.py:521-539), as a DEALER reads it: (b"", topic,
    seq, payload) per batch, then (b"", b"", -1 as 8 signed big-endian bytes, b"").
    """
    decoder = msgspec.msgpack.Decoder(type=VllmKVEventBatch)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        out: list[tuple[int, VllmKVEventBatch]] = []
        while dealer.poll(10_000):
            frames = dealer.recv_multipart()
            if frames == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]:
                return out
            empty, got_topic, seq, payload = frames
            assert (empty, got_topic, len(seq)) == (b"", topic.encode(), 8)
            out.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        raise AssertionError("no end-of-replay marker")
    finally:
        dealer.close()
        ctx.term()


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

        # vLLM 0.33.0's decoder reads every payload the engine published, and the
        # blocks it describes are the pool's.
        assert cfg.replay_endpoint is not None
        vllm_batches = _replay_as_vllm_client(cfg.replay_endpoint, cfg.topic)
        assert [seq for seq, _ in vllm_batches] == list(range(publisher.next_seq))
        vllm_blocks: Counter[tuple[str, int | None, int | bytes]] = Counter()
        roots = 0
        for _, vllm_batch in vllm_batches:
            assert vllm_batch.data_parallel_rank == 0
            for e in vllm_batch.events:
                if isinstance(e, VllmBlockStored):
                    # The model's one full-attention group, as vLLM 0.33.0 labels it.
                    assert (e.medium, e.group_idx, e.block_size) == ("GPU", 0, 4)
                    assert e.kv_cache_spec_kind == "full_attention"
                    assert e.kv_cache_spec_sliding_window is None
                    assert len(e.token_ids) == 4 * len(e.block_hashes)
                    assert e.lora_id is None and e.lora_name is None
                    if e.parent_block_hash is None:  # the hashes are vLLM's own
                        roots += 1
                        assert e.block_hashes == _vllm_chain(None, e.token_ids, e.block_size)
                    vllm_blocks.update(("GPU", e.group_idx, h) for h in e.block_hashes)
                elif isinstance(e, VllmBlockRemoved):
                    assert (e.medium, e.group_idx) == ("GPU", 0)
                    vllm_blocks.subtract(("GPU", e.group_idx, h) for h in e.block_hashes)
        assert +vllm_blocks == expected and roots > 0

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

        wrong = _run_example(cfg, "--until-seq", "2")  # --wire-format vllm, the default
        assert wrong.returncode == 1
        assert "not a batch in the 'vllm' wire layout" in wrong.stderr
    finally:
        publisher.shutdown()
