"""EngineCore publishes the KV cache events of each step (fake executor, real scheduler).

A subscriber that knows only the event stream rebuilds the cached block
hashes and must agree with the pool's own index after a random workload.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from paged.connectors.events import (
    CachedBlockIndex,
    KVEventsConfig,
    KVEventSubscriber,
    NullEventPublisher,
    ZmqEventPublisher,
    external_block_hash,
)
from paged.connectors.kv.offloading import OffloadingConnector
from paged.connectors.kv.offloading.metadata import Tier
from paged.connectors.kv.offloading.storage import CHUNK_SUFFIX
from paged.kvcache.ids import get_block_hash, get_group_id
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.client import SyncMPClient
from paged.server.engine.core import EngineCore, make_engine_core_factory
from paged.server.engine.errors import EngineStartupError
from paged.server.kv_transfer import kv_bytes_per_block, kv_connector_builder

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path: Path) -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/kv-pub",
        replay_endpoint=f"ipc://{tmp_path}/kv-replay",
        topic="kv-events",
    )


def pool_blocks(core: EngineCore) -> Counter[tuple[int | None, int | bytes]]:
    """The pool's own cached blocks, as (group, published hash) with multiplicity."""
    scheduler: Any = core.scheduler
    pool = scheduler.state.kv.block_pool
    return Counter(
        (get_group_id(key), external_block_hash(get_block_hash(key)))
        for key, _ in pool.cached_block_hash_to_block.items()
    )


def _request(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=None,
        arrival_time=time.time(),
    )


def _random_workload(core: EngineCore, rng: random.Random, n: int, vocab: int) -> int:
    """Requests sharing prefixes (hits), longer than the cache holds (evictions)."""
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    steps = 0
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        core.add_request(_request(f"r{i}", prompt, rng.randrange(1, 6)))
        if rng.random() < 0.5:
            core.run_step()
            steps += 1
    while core.has_work():
        core.run_step()
        steps += 1
    return steps


def _drain(sub: KVEventSubscriber, index: CachedBlockIndex, until_seq: int) -> Counter[str]:
    """Apply batches up to `until_seq`; returns how many events of each kind came."""
    kinds: Counter[str] = Counter()
    deadline = time.monotonic() + 30
    while sub.next_seq < until_seq and time.monotonic() < deadline:
        # A SUB socket misses what was sent before it finished connecting (ZMQ's slow
        # joiner); with nothing newer arriving, only replay brings those batches.
        for _, batch in sub.poll(100) or sub.catch_up(timeout_ms=500):
            index.apply(batch)
            kinds.update(type(e).__name__ for e in batch.events)
    assert sub.next_seq == until_seq, f"got {sub.next_seq} of {until_seq} batches"
    return kinds


@pytest.mark.parametrize("batch_queue_size", [1, 2])
def test_subscriber_rebuilds_the_pools_cached_blocks(
    tmp_path: Path, engine_config_factory: Any, fake_executor_cls: Any, batch_queue_size: int
) -> None:
    cfg = _config(tmp_path)
    core = EngineCore(
        engine_config_factory(kv_cache_memory_bytes=1 << 13),  # 32 blocks of 4 tokens
        fake_executor_cls,
        kv_events_config=cfg,
        batch_queue_size=batch_queue_size,
    )
    live = KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint, topic=cfg.topic)
    try:
        publisher = core.event_publisher
        assert isinstance(publisher, ZmqEventPublisher)
        index = CachedBlockIndex()
        rng = random.Random(batch_queue_size)
        _random_workload(core, rng, 30, vocab=128)
        assert publisher.next_seq > 5
        kinds = _drain(live, index, publisher.next_seq)
        assert kinds["BlockStored"] > 0 and kinds["BlockRemoved"] > 0  # the cache churned
        expected = pool_blocks(core)
        assert expected and index.hashes("GPU") == expected
        assert index.num_unknown_removals == 0 and live.num_lost == 0

        # reset on an idle engine goes out at once, without another step.
        assert core.reset_prefix_cache()
        assert _drain(live, index, publisher.next_seq) == Counter(AllBlocksCleared=1)
        assert index.hashes("GPU") == Counter() == pool_blocks(core)

        _random_workload(core, rng, 10, vocab=128)
        _drain(live, index, publisher.next_seq)
        assert index.hashes("GPU") == pool_blocks(core)

        # A subscriber joining now rebuilds the same state from replay alone.
        with KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint, topic=cfg.topic) as late:
            late_index = CachedBlockIndex()
            for _, batch in late.catch_up():
                late_index.apply(batch)
            assert late.next_seq == publisher.next_seq
            assert late_index.hashes("GPU") == pool_blocks(core)
    finally:
        live.close()
        core.shutdown()


def _with_offloading(config: Any, executor: Any, disk: Path, host_chunks: int) -> Any:
    """`config` with an OffloadingConnector: chunks of 8 tokens, a small host tier, a disk."""
    probe = EngineCore(config, executor)  # only for the bytes of one block
    chunk_bytes = 2 * kv_bytes_per_block(probe.kv_cache_config)
    probe.shutdown()
    extra = {"chunk_size": 8, "kv_bytes_per_rank": host_chunks * chunk_bytes}
    builder = kv_connector_builder(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {**extra, "disk_path": str(disk)},
        },
        config.cache_config.block_size,
    )
    return dataclasses.replace(config, kv_connector_factory=builder)


def tier_blocks(core: EngineCore, tier: Tier) -> Counter[tuple[int | None, int | bytes]]:
    """What one tier of the connector holds, as (group, published hash) with multiplicity."""
    connector = core.kv_connector
    assert isinstance(connector, OffloadingConnector)
    chunks = connector.scheduler_side.tier_block_hashes(tier)
    return Counter((0, external_block_hash(h)) for hashes in chunks.values() for h in hashes)


def test_subscriber_rebuilds_the_offload_tiers_next_to_the_pool(
    tmp_path: Path, engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    cfg = _config(tmp_path)
    base = engine_config_factory(kv_cache_memory_bytes=1 << 13)
    config = _with_offloading(base, fake_executor_cls, tmp_path / "kv", host_chunks=6)
    core = EngineCore(config, fake_executor_cls, kv_events_config=cfg)
    live = KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint, topic=cfg.topic)
    try:
        publisher = core.event_publisher
        assert isinstance(publisher, ZmqEventPublisher)
        index = CachedBlockIndex()
        _random_workload(core, random.Random(7), 30, vocab=128)
        kinds = _drain(live, index, publisher.next_seq)
        assert kinds["BlockRemoved"] > 0  # the pool and the host tier churned
        expected = {"GPU": pool_blocks(core), "CPU": tier_blocks(core, Tier.HOST)}
        expected["STORAGE"] = tier_blocks(core, Tier.DISK)
        assert all(expected.values())
        assert {m: index.hashes(m) for m in expected} == expected
        assert index.num_unknown_removals == 0 and live.num_lost == 0
        # A tier block is a pool block of the same prompt: one hash form for all media.
        assert set(expected["CPU"]) <= set(expected["STORAGE"])
        connector = core.kv_connector
        assert isinstance(connector, OffloadingConnector)
        disk_keys = list(connector.scheduler_side.tier_block_hashes(Tier.DISK))
    finally:
        live.close()
        core.shutdown()

    # The fake executor runs no worker side: write the files it would have, then a
    # new engine on the same disk announces what it finds (known by key only, the
    # hash of each chunk's last block) and a late subscriber learns it from replay.
    (tmp_path / "kv").mkdir(exist_ok=True)
    for key in disk_keys:
        (tmp_path / "kv" / f"{key}{CHUNK_SUFFIX}").write_bytes(b"\0" * 64)
    (tmp_path / "second").mkdir()
    cfg = _config(tmp_path / "second")
    core = EngineCore(config, fake_executor_cls, kv_events_config=cfg)
    try:
        publisher = core.event_publisher
        assert isinstance(publisher, ZmqEventPublisher)
        assert publisher.next_seq == 1  # the start-up batch
        with KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint, topic=cfg.topic) as late:
            late_index = CachedBlockIndex()
            for _, batch in late.catch_up():
                late_index.apply(batch)
            disk = tier_blocks(core, Tier.DISK)
            assert sorted(h for _, h in disk) == sorted(
                external_block_hash(bytes.fromhex(k)) for k in disk_keys
            )
            assert set(disk) <= set(expected["STORAGE"])  # each a block hash published before
            assert late_index.hashes("STORAGE") == disk
            assert late_index.hashes("GPU") == Counter() == late_index.hashes("CPU")
    finally:
        core.shutdown()


def test_one_batch_per_step_with_events(
    tmp_path: Path, engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    cfg = _config(tmp_path)
    core = EngineCore(engine_config_factory(), fake_executor_cls, kv_events_config=cfg)
    try:
        publisher = core.event_publisher
        assert isinstance(publisher, ZmqEventPublisher)
        core.add_request(_request("a", list(range(1, 13)), 2))  # 3 full blocks of 4
        core.run_step()  # prefill: stores blocks 0..2
        assert publisher.next_seq == 1
        core.run_step()  # decode 1 token: no new full block, no batch
        assert publisher.next_seq == 1
        while core.has_work():
            core.run_step()
        assert publisher.next_seq == 1
    finally:
        core.shutdown()


def test_without_config_no_events_are_recorded(
    engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    core = EngineCore(engine_config_factory(), fake_executor_cls)
    try:
        assert isinstance(core.event_publisher, NullEventPublisher)
        core.add_request(_request("a", list(range(1, 13)), 2))
        core.run_step()
        assert core.scheduler.take_kv_cache_events() == []
    finally:
        core.shutdown()


@pytest.mark.slow
def test_engine_process_publishes_and_a_busy_endpoint_fails_startup(
    tmp_path: Path, engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    cfg = _config(tmp_path)
    factory = make_engine_core_factory(
        engine_config_factory(), fake_executor_cls, kv_events_config=cfg
    )
    client = SyncMPClient(factory, startup_timeout_s=60)
    try:
        with KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint, topic=cfg.topic) as sub:
            client.add_request(_request("a", list(range(1, 13)), 2))
            finished = False
            while not finished:
                finished = any(o.finished for o in client.get_output(timeout=30).outputs)
            index = CachedBlockIndex()
            deadline = time.monotonic() + 30
            while not index.blocks and time.monotonic() < deadline:
                for _, batch in sub.poll(100) or sub.catch_up():
                    index.apply(batch)
            assert sum(index.hashes("GPU").values()) == 3  # three full blocks of 4 tokens
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            busy = KVEventsConfig(
                enable_kv_cache_events=True,
                endpoint=f"ipc://{tmp_path}/other",
                replay_endpoint=f"tcp://127.0.0.1:{held.getsockname()[1]}",
            )
            bad = make_engine_core_factory(
                engine_config_factory(), fake_executor_cls, kv_events_config=busy
            )
            with pytest.raises(EngineStartupError, match="KV events publisher cannot open"):
                SyncMPClient(bad, startup_timeout_s=60)
    finally:
        client.shutdown()
