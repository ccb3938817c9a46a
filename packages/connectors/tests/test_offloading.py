"""OffloadingConnector over a real Scheduler and real KV tensors: tiers, restart, corruption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from paged.connectors.kv import (
    KVConnectorContext,
    KVConnectorFactory,
    KVConnectorRole,
    KVTransferConfig,
)
from paged.connectors.kv.offloading import OffloadingConnector
from paged.connectors.kv.offloading.chunks import chunk_keys
from paged.connectors.kv.offloading.metadata import Tier
from paged.connectors.kv.offloading.storage import CHUNK_SUFFIX
from paged.connectors.kv.testing import (
    HEAD_SIZE,
    NUM_HEADS,
    NUM_LAYERS,
    KVWorkerSim,
    expected_kv,
    make_kv_caches,
)
from paged.kvcache import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    get_request_block_hasher,
    sha256,
)
from paged.scheduler.boundary import ModelRunnerOutput, SchedulerOutput
from paged.scheduler.connectors import KVConnectorScheduler
from paged.scheduler.request import Request
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import BLOCK_SIZE, make_request, make_scheduler

NUM_BLOCKS = 48
CHUNK = 8  # two blocks of 4
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_HEADS * HEAD_SIZE * 4
CHUNK_BYTES = BLOCK_BYTES * CHUNK // BLOCK_SIZE
PROMPT = list(range(10, 37))  # 27 tokens: three full chunks and three tokens

_SCHEDULER_SIDE: type[KVConnectorScheduler] = OffloadingConnector


def _config(extra: dict[str, Any], role: str = "kv_both") -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role=role,  # type: ignore[arg-type]
        kv_connector_extra_config={"chunk_size": CHUNK, **extra},
    )


class _Engine:
    """A scheduler and a simulated worker sharing one OffloadingConnector config."""

    def __init__(
        self,
        extra: dict[str, Any],
        role: str = "kv_both",
        dtype: torch.dtype = torch.float32,
        events: bool = False,
    ) -> None:
        cfg = _config(extra, role)
        ctx = KVConnectorContext(block_size=BLOCK_SIZE, kv_bytes_per_block=BLOCK_BYTES)
        self.sched_side = OffloadingConnector(cfg, KVConnectorRole.SCHEDULER, ctx)
        self.worker_side = OffloadingConnector(cfg, KVConnectorRole.WORKER, ctx)
        self.sched: Scheduler = make_scheduler(
            NUM_BLOCKS, kv_connector=self.sched_side, enable_kv_cache_events=events
        )
        caches = {k: v.to(dtype) for k, v in make_kv_caches(NUM_BLOCKS, BLOCK_SIZE).items()}
        self.sim = KVWorkerSim(self.worker_side, caches, BLOCK_SIZE)

        self.stats: dict[str, float] = {}  # SchedulerStats.kv_connector_stats, summed

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        for outputs in self.sched.update_from_output(so, out).values():
            if outputs.scheduler_stats is not None:
                for name, value in outputs.scheduler_stats.kv_connector_stats.items():
                    self.stats[name] = self.stats.get(name, 0.0) + value

    def run(self, rid: str, prompt: list[int], max_tokens: int = 1) -> None:
        self.sched.add_request(make_request(rid, prompt, max_tokens=max_tokens))
        for _ in range(100):
            if not self.sched.has_requests():
                self.worker_side.worker_side.writer.flush()
                return
            so = self.sched.schedule()
            self.update(so, self.sim.execute(so))
        raise AssertionError("did not finish")

    def forget_device_cache(self) -> None:
        assert self.sched.reset_prefix_cache()
        for cache in self.sim.kv_caches.values():
            cache.zero_()

    def close(self) -> None:
        self.worker_side.shutdown()


def _assert_kv(engine: _Engine, rid: str, prompt: list[int], num_tokens: int) -> None:
    loaded = engine.sim.kv_of(rid, num_tokens)
    for name, kv in expected_kv(prompt, num_tokens).items():
        torch.testing.assert_close(loaded[name], kv, rtol=0, atol=0)


def _keys(prompt: list[int]) -> list[str]:
    """The chunk keys the engines compute for `prompt` (hash seed 0, as make_scheduler)."""
    make_scheduler(NUM_BLOCKS)  # sets this process's NONE_HASH from hash_seed 0
    req = Request.from_engine_core_request(
        make_request("probe", prompt),
        max_model_len=256,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    return list(chunk_keys(req.block_hashes, CHUNK // BLOCK_SIZE))


# --------------------------------------------------------------------- host tier
def test_host_tier_round_trips_real_kv_after_a_device_cache_reset() -> None:
    engine = _Engine({"kv_bytes_per_rank": 10 * CHUNK_BYTES})
    engine.run("a", PROMPT)
    host = engine.sched_side.scheduler_side.host
    assert host is not None and host.keys_lru_first() == _keys(PROMPT)
    assert len(engine.worker_side.worker_side.host or ()) == 3
    engine.forget_device_cache()
    engine.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = engine.sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    assert so.num_scheduled_tokens == {"b": 3}
    out = engine.sim.execute(so)
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == []
    _assert_kv(engine, "b", PROMPT, 24)
    assert engine.sim.computed_positions["b"] == [24, 25, 26]  # 0..23 came from the host tier
    engine.update(so, out)
    # Through SchedulerStats: scheduler-side lookups and worker-side bytes alike.
    stats = engine.stats
    assert stats["host.hits"] == 24 and stats["host.queries"] == 48  # 24 saved-run + 24 hit-run
    assert stats["host.bytes_loaded"] == 3 * CHUNK_BYTES
    assert stats["host.bytes_saved"] == 3 * CHUNK_BYTES
    assert "disk.queries" not in stats  # no disk tier configured
    engine.close()


def test_a_prompt_ending_on_a_chunk_boundary_leaves_its_last_token_to_compute() -> None:
    engine = _Engine({"kv_bytes_per_rank": 10 * CHUNK_BYTES})
    prompt = PROMPT[:24]  # exactly three chunks
    engine.run("a", prompt)
    engine.forget_device_cache()
    engine.sched.add_request(make_request("b", prompt, max_tokens=1))
    so = engine.sched.schedule()
    # 20 = the last block boundary before token 23; chunk 2 is loaded in part.
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20
    engine.sim.execute(so)
    _assert_kv(engine, "b", prompt, 20)
    assert engine.sim.computed_positions["b"] == [20, 21, 22, 23]
    engine.close()


def test_a_local_hit_inside_a_chunk_loads_only_the_blocks_beyond_it() -> None:
    engine = _Engine({"kv_bytes_per_rank": 10 * CHUNK_BYTES})
    engine.run("a", PROMPT)
    assert engine.sched.reset_prefix_cache()
    engine.run("c", [*PROMPT[:4], 90, 91, 92, 93, 94])  # caches block 0 of the prompt
    so = engine.sched.schedule()  # nothing runs; just find c's first block
    del so
    engine.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = engine.sched.schedule()
    new = so.scheduled_new_reqs[0]
    shared = new.block_ids[0][0]
    for cache in engine.sim.kv_caches.values():
        cache[:, shared] = 7.0  # the load must leave the locally cached block alone
    assert new.num_computed_tokens == 24
    engine.sim.execute(so)
    loaded = engine.sim.kv_of("b", 24)
    for name, kv in expected_kv(PROMPT, 24).items():
        assert bool((loaded[name][:, :4] == 7.0).all())
        torch.testing.assert_close(loaded[name][:, 4:], kv[:, 4:], rtol=0, atol=0)
    engine.close()


def test_host_budget_evicts_the_least_recently_used_chunks() -> None:
    engine = _Engine({"kv_bytes_per_rank": 2 * CHUNK_BYTES})
    prompts = {name: [base + i for i in range(9)] for name, base in (("a", 100), ("b", 200))}
    prompts["c"] = [300 + i for i in range(9)]
    engine.run("a", prompts["a"])
    engine.run("b", prompts["b"])
    engine.forget_device_cache()
    engine.run("a2", prompts["a"])  # a hit touches a: b is now the oldest
    engine.run("c", prompts["c"])
    host = engine.sched_side.scheduler_side.host
    assert host is not None
    assert host.keys_lru_first() == [_keys(prompts["a"])[0], _keys(prompts["c"])[0]]
    assert host.num_evictions == 1
    host.check_integrity()
    assert len(engine.worker_side.worker_side.host or ()) == 2  # the worker evicted b too
    assert engine.stats["host.evictions"] == 1
    engine.forget_device_cache()
    engine.sched.add_request(make_request("b2", prompts["b"], max_tokens=1))
    assert engine.sched.schedule().scheduled_new_reqs[0].num_computed_tokens == 0
    engine.close()


# --------------------------------------------------------------------- disk tier
def test_disk_tier_survives_a_restart(tmp_path: Path) -> None:
    first = _Engine({"disk_path": str(tmp_path)})
    first.run("a", PROMPT)
    first.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{k}{CHUNK_SUFFIX}" for k in _keys(PROMPT)
    )
    # A new engine on the same directory: fresh scheduler, fresh (zero) KV cache.
    second = _Engine({"disk_path": str(tmp_path)})
    second.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = second.sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    out = second.sim.execute(so)
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == []
    _assert_kv(second, "b", PROMPT, 24)
    second.update(so, out)
    assert second.stats["disk.bytes_loaded"] == 3 * CHUNK_BYTES
    assert second.stats["disk.hits"] == 24
    second.close()


def test_host_and_disk_write_through_and_a_disk_hit_is_promoted_to_host(
    tmp_path: Path,
) -> None:
    extra = {"disk_path": str(tmp_path), "kv_bytes_per_rank": 10 * CHUNK_BYTES}
    first = _Engine(extra)
    first.run("a", PROMPT)
    first.close()
    assert len(list(tmp_path.iterdir())) == 3
    second = _Engine(extra)  # host memory is empty after the restart
    second.run("b", PROMPT)
    host = second.sched_side.scheduler_side.host
    assert host is not None and len(host) == 3
    assert len(second.worker_side.worker_side.host or ()) == 3
    second.forget_device_cache()
    second.sched.add_request(make_request("c", PROMPT, max_tokens=1))
    so = second.sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    second.update(so, second.sim.execute(so))
    _assert_kv(second, "c", PROMPT, 24)
    stats = second.stats
    assert stats["disk.hits"] == 24 and stats["host.hits"] == 24  # run b from disk, c from host
    assert stats["host.bytes_loaded"] == stats["disk.bytes_loaded"] == 3 * CHUNK_BYTES
    second.close()


def test_disk_budget_is_enforced_at_start_up(tmp_path: Path) -> None:
    first = _Engine({"disk_path": str(tmp_path)})
    first.run("a", PROMPT)
    first.close()
    second = _Engine({"disk_path": str(tmp_path), "disk_bytes_per_rank": 2 * CHUNK_BYTES + 500})
    disk = second.sched_side.scheduler_side.disk
    assert disk is not None and len(disk) == 2
    second.run("x", [1, 2, 3])  # one step carries the start-up evictions to the worker
    assert len(list(tmp_path.iterdir())) == 2
    second.close()


def _restart_with_damage(tmp_path: Path, damage: str) -> tuple[_Engine, list[int]]:
    first = _Engine({"disk_path": str(tmp_path)})
    first.run("a", PROMPT)
    first.close()
    path = tmp_path / f"{_keys(PROMPT)[1]}{CHUNK_SUFFIX}"
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-64])
    second = _Engine({"disk_path": str(tmp_path)})
    if damage == "delete":
        path.unlink()  # disappears after the index was rebuilt
    second.sched.add_request(make_request("b", PROMPT, max_tokens=2))
    so = second.sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    out = second.sim.execute(so)
    assert out.kv_connector_output is not None
    blocks = list(so.scheduled_new_reqs[0].block_ids[0])
    assert out.kv_connector_output.invalid_block_ids == sorted(blocks[2:4])  # chunk 1
    second.update(so, out)
    return second, blocks


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_or_missing_chunk_is_a_load_error_and_recomputed(
    tmp_path: Path, damage: str
) -> None:
    engine, _ = _restart_with_damage(tmp_path, damage)
    so = engine.sched.schedule()
    # Recompute from the first bad block (token 8); chunk 0 stays valid.
    assert so.scheduled_cached_reqs.num_computed_tokens == [8]
    assert so.num_scheduled_tokens == {"b": len(PROMPT) - 8}
    engine.update(so, engine.sim.execute(so))
    engine.worker_side.worker_side.writer.flush()
    assert engine.stats["load_errors"] == 1  # the worker's failed chunk, via SchedulerStats
    _assert_kv(engine, "b", PROMPT, 24)  # recomputed KV equals the original
    # The bad file was deleted and the recomputed chunk saved again in its place.
    disk = engine.sched_side.scheduler_side.disk
    assert disk is not None and _keys(PROMPT)[1] in disk
    engine.close()
    third = _Engine({"disk_path": str(tmp_path)})
    third.sched.add_request(make_request("c", PROMPT, max_tokens=1))
    so = third.sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    out = third.sim.execute(so)
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == []
    _assert_kv(third, "c", PROMPT, 24)
    third.close()


def test_a_foreign_layout_chunk_is_a_load_error(tmp_path: Path) -> None:
    first = _Engine({"disk_path": str(tmp_path)}, dtype=torch.float64)
    first.run("a", PROMPT)
    first.close()
    second = _Engine({"disk_path": str(tmp_path)})
    second.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = second.sched.schedule()
    out = second.sim.execute(so)
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == sorted(
        so.scheduled_new_reqs[0].block_ids[0][:6]
    )
    second.close()


# --------------------------------------------------------------------- roles, config
def test_consumer_only_never_saves_and_producer_only_never_loads(tmp_path: Path) -> None:
    consumer = _Engine({"disk_path": str(tmp_path)}, role="kv_consumer")
    consumer.run("a", PROMPT)
    assert list(tmp_path.iterdir()) == []
    consumer.close()
    both = _Engine({"disk_path": str(tmp_path)})
    both.run("a", PROMPT)
    both.close()
    producer = _Engine({"disk_path": str(tmp_path)}, role="kv_producer")
    producer.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    assert producer.sched.schedule().scheduled_new_reqs[0].num_computed_tokens == 0
    producer.close()


def test_the_factory_builds_it_and_bad_configs_are_named(tmp_path: Path) -> None:
    ctx = KVConnectorContext(block_size=BLOCK_SIZE, kv_bytes_per_block=BLOCK_BYTES)
    built = KVConnectorFactory.with_builtins().create_connector(
        _config({"kv_bytes_per_rank": 1 << 20}), KVConnectorRole.SCHEDULER, ctx
    )
    assert isinstance(built, OffloadingConnector)
    with pytest.raises(ValueError, match="kv_bytes_per_block"):
        OffloadingConnector(
            _config({"kv_bytes_per_rank": 1 << 20}),
            KVConnectorRole.SCHEDULER,
            KVConnectorContext(block_size=BLOCK_SIZE),
        )
    with pytest.raises(ValueError, match="no kv_cache_groups layouts"):
        OffloadingConnector(
            _config({"kv_bytes_per_rank": 1 << 20}),
            KVConnectorRole.SCHEDULER,
            KVConnectorContext(block_size=BLOCK_SIZE, num_kv_cache_groups=2),
        )
    with pytest.raises(ValueError, match="multiple of the block size"):
        OffloadingConnector(
            _config({"kv_bytes_per_rank": 1, "chunk_size": 6}), KVConnectorRole.WORKER, ctx
        )


# ------------------------------------------------------------ KV cache events
def _stored(events: list[Any], medium: str) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


def _removed(events: list[Any], medium: str) -> list[list[BlockHash]]:
    return [e.block_hashes for e in events if isinstance(e, BlockRemoved) and e.medium == medium]


def test_tiers_publish_the_device_pools_hashes_and_their_evictions(tmp_path: Path) -> None:
    extra = {"kv_bytes_per_rank": 2 * CHUNK_BYTES, "disk_path": str(tmp_path)}
    engine = _Engine(extra, events=True)
    engine.run("a", PROMPT)
    events = engine.sched.take_kv_cache_events()
    gpu = [h for e in _stored(events, "GPU") for h in e.block_hashes]
    assert len(gpu) == 6  # the pool's hashes of the prompt's full blocks, in order
    for medium in ("CPU", "STORAGE"):  # write-through: every chunk to both tiers, in order
        stored = _stored(events, medium)
        assert [e.block_hashes for e in stored] == [gpu[0:2], gpu[2:4], gpu[4:6]]
        assert [e.parent_block_hash for e in stored] == [None, gpu[1], gpu[3]]
        assert [e.token_ids for e in stored] == [PROMPT[0:8], PROMPT[8:16], PROMPT[16:24]]
        assert {(e.block_size, e.group_idx) for e in stored} == {(BLOCK_SIZE, 0)}
        assert stored[0].extra_keys == [None, None]
    # Host memory holds two chunks: the third one evicted chunk 0 there, not on disk.
    assert _removed(events, "CPU") == [gpu[0:2]]
    assert _removed(events, "STORAGE") == []
    side = engine.sched_side.scheduler_side
    keys = _keys(PROMPT)
    assert side.tier_block_hashes(Tier.HOST) == {keys[1]: gpu[2:4], keys[2]: gpu[4:6]}
    assert list(side.tier_block_hashes(Tier.DISK).values()) == [gpu[0:2], gpu[2:4], gpu[4:6]]
    assert engine.sched.take_kv_cache_events() == []  # taken once
    engine.close()


def test_a_restart_announces_the_disk_and_a_load_error_removes_the_chunk(
    tmp_path: Path,
) -> None:
    first = _Engine({"disk_path": str(tmp_path)})
    first.run("a", PROMPT)
    first.close()
    path = tmp_path / f"{_keys(PROMPT)[1]}{CHUNK_SUFFIX}"
    path.write_bytes(path.read_bytes()[:-64])
    second = _Engine({"disk_path": str(tmp_path)}, events=True)
    # Known only by their keys (the last block's hash); scan order is write order.
    keys = [bytes.fromhex(k) for k in _keys(PROMPT)]
    startup = second.sched.take_kv_cache_events()
    assert sorted(e.block_hashes for e in _stored(startup, "STORAGE")) == sorted([k] for k in keys)
    assert {(e.block_size, len(e.token_ids)) for e in _stored(startup, "STORAGE")} == {(CHUNK, 0)}
    second.sched.add_request(make_request("b", PROMPT, max_tokens=2))
    so = second.sched.schedule()
    second.update(so, second.sim.execute(so))  # chunk 1 fails its load
    assert _removed(second.sched.take_kv_cache_events(), "STORAGE") == [[keys[1]]]
    so = second.sched.schedule()  # recomputed and saved again, now with every hash
    second.update(so, second.sim.execute(so))
    again = _stored(second.sched.take_kv_cache_events(), "STORAGE")
    assert [e.block_hashes[-1] for e in again] == [keys[1]] and len(again[0].block_hashes) == 2
    side = second.sched_side.scheduler_side
    assert len(side.tier_block_hashes(Tier.DISK)) == 3
    second.close()


# ------------------------------------------------------- vLLM 0.33's store policy keys
def test_store_threshold_stores_a_chunk_only_once_it_was_offered_that_often() -> None:
    # vLLM 0.33 CPUOffloadingManager.prepare_store: a new chunk is stored once its
    # offer count reaches store_threshold (here 2: the second request computing it).
    engine = _Engine({"cpu_bytes_to_use": 10 * CHUNK_BYTES, "store_threshold": 2})
    engine.run("a", PROMPT)
    scheduler_side = engine.sched_side.scheduler_side
    assert scheduler_side.host is not None and len(scheduler_side.host) == 0
    assert scheduler_side.admission.skipped == 3
    engine.forget_device_cache()
    engine.run("b", PROMPT)  # a miss again: computed, offered a second time, stored
    assert scheduler_side.host.keys_lru_first() == _keys(PROMPT)
    engine.forget_device_cache()
    engine.sched.add_request(make_request("c", PROMPT, max_tokens=1))
    assert engine.sched.schedule().scheduled_new_reqs[0].num_computed_tokens == 24
    engine.close()


@pytest.mark.parametrize(("prompt_only", "chunks"), [(True, 3), (False, 4)])
def test_offload_prompt_only_false_also_saves_decode_chunks(prompt_only: bool, chunks: int) -> None:
    # 27 prompt tokens + 10 generated: KV exists for 36 tokens, four full chunks of 8;
    # the fourth holds decode tokens 27..31, saved only with offload_prompt_only false.
    engine = _Engine({"kv_bytes_per_rank": 10 * CHUNK_BYTES, "offload_prompt_only": prompt_only})
    engine.run("a", PROMPT, max_tokens=10)
    host = engine.sched_side.scheduler_side.host
    assert host is not None and len(host) == chunks
    assert len(engine.worker_side.worker_side.host or ()) == chunks
    engine.close()


@pytest.mark.parametrize("enable", [False, True])
def test_an_fs_tier_publishes_storage_events_only_with_enable_kv_events(
    tmp_path: Path, enable: bool
) -> None:
    # vLLM 0.33 fs tier: enable_kv_events (default false) opts into STORAGE BlockStored.
    fs = {"type": "fs", "root_dir": str(tmp_path), "enable_kv_events": enable}
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 10 * CHUNK_BYTES,
        "secondary_tiers": [fs],
    }
    engine = _Engine(extra, events=True)
    engine.run("a", PROMPT)
    events = engine.sched.take_kv_cache_events()
    assert len(_stored(events, "CPU")) == 3
    assert len(_stored(events, "STORAGE")) == (3 if enable else 0)
    side = engine.sched_side.scheduler_side
    assert side.disk is not None and len(side.disk) == 3  # stored either way
    assert len(side.tier_block_hashes(Tier.DISK)) == 3
    engine.close()


@pytest.mark.parametrize(("policy", "kept"), [("lru", "b"), ("arc", "a")])
def test_eviction_policy_arc_keeps_a_reused_chunk_that_lru_evicts(policy: str, kept: str) -> None:
    # Host tier of two chunks. a is stored and reused; then b and c are stored once.
    # LRU evicts a (least recently used); ARC evicts b (seen once, T1) and keeps a (T2).
    engine = _Engine({"kv_bytes_per_rank": 2 * CHUNK_BYTES, "eviction_policy": policy})
    prompts = {name: [base + i for i in range(9)] for name, base in (("a", 100), ("b", 200))}
    prompts["c"] = [300 + i for i in range(9)]
    engine.run("a", prompts["a"])
    engine.forget_device_cache()
    engine.run("a2", prompts["a"])  # a host-tier hit: a reuse
    engine.run("b", prompts["b"])
    engine.run("c", prompts["c"])
    host = engine.sched_side.scheduler_side.host
    assert host is not None
    assert sorted(host.keys_lru_first()) == sorted(
        [_keys(prompts[kept])[0], _keys(prompts["c"])[0]]
    )
    assert len(engine.worker_side.worker_side.host or ()) == 2
    engine.close()
