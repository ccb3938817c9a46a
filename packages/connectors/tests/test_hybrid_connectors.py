"""Hybrid models (full + sliding-window KV cache groups) through every connector.

The scheduler runs a real hybrid KV cache (layer 0 full attention, layer 1 a
sliding window of `WINDOW` tokens, one block pool); the simulated worker
writes K/V that depend only on (layer, position, token). A sliding-window
group needs only the blocks of the window before the resume point
(`groups.window_start_block`): connectors store and move those alone.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import msgspec
import pytest
import redis
import safetensors
import torch

from paged.connectors.kv import KVConnectorContext, KVConnectorRole, KVTransferConfig
from paged.connectors.kv.groups import (
    GroupLayout,
    check_layer_groups,
    group_layouts,
    window_start_block,
)
from paged.connectors.kv.offloading import OffloadingConnector
from paged.connectors.kv.offloading.chunks import ChunkKey, chunk_keys, group_chunk_key
from paged.connectors.kv.offloading.metadata import OffloadingMetadata, Tier
from paged.connectors.kv.offloading.redis_server import RedisServer
from paged.connectors.kv.p2p import PagedZmqConnector
from paged.connectors.kv.shared_storage import SharedStorageConnector, prefix_key
from paged.connectors.kv.testing import (
    HYBRID_LAYER_GROUPS,
    KVWorkerSim,
    expected_kv,
    hybrid_context,
    hybrid_kv_config,
    layer_name,
    make_kv_caches,
)
from paged.kvcache import (
    BlockStored,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    get_request_block_hasher,
    sha256,
)
from paged.scheduler.boundary import EngineCoreOutput, KVTransferParams
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.connectors import KVConnectorScheduler
from paged.scheduler.request import Request, RequestStatus
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import BLOCK_SIZE, make_request

NUM_BLOCKS = 64
WINDOW = 6  # a resume at token t needs blocks from (t - 5) // 4 on
WINDOWS = (None, WINDOW)


def _scheduler(connector: KVConnectorScheduler | None, budget: int = 2048) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=256, max_num_seqs=min(8, budget), max_num_batched_tokens=budget
    )
    return Scheduler(
        config,
        hybrid_kv_config(NUM_BLOCKS, BLOCK_SIZE, WINDOW),
        BLOCK_SIZE,
        kv_connector=connector,
        hash_seed=0,
    )


def _run(sched: Scheduler, sim: KVWorkerSim) -> None:
    for _ in range(200):
        if not sched.has_requests():
            return
        so = sched.schedule()
        sched.update_from_output(so, sim.execute(so))
    raise AssertionError("did not finish")


def _firsts(num_tokens: int) -> list[int]:
    """Per layer, the first token a resume at `num_tokens` needs (layer 1 is sliding)."""
    return [window_start_block(w, num_tokens, BLOCK_SIZE) * BLOCK_SIZE for w in WINDOWS]


def _assert_window_kv(sim: KVWorkerSim, rid: str, prompt: list[int], n: int) -> None:
    loaded = sim.window_kv_of(rid, n, WINDOWS)
    for name, kv in expected_kv(prompt, n, _firsts(n)).items():
        torch.testing.assert_close(loaded[name], kv, rtol=0, atol=0)


# ------------------------------------------------------------------ group layouts
def test_window_start_block_matches_the_managers_skipped_blocks() -> None:
    assert window_start_block(None, 100, 4) == 0
    assert window_start_block(6, 5, 4) == 0
    assert window_start_block(6, 16, 4) == 2  # tokens 11..15: blocks 2 and 3
    assert window_start_block(6, 24, 4) == 4


def test_group_layouts_of_an_engine_and_what_connectors_refuse() -> None:
    layouts = group_layouts(hybrid_kv_config(8, BLOCK_SIZE, WINDOW), BLOCK_SIZE)
    block_bytes = 2 * BLOCK_SIZE * 2 * 4 * 4
    assert layouts == (
        GroupLayout((layer_name(0),), None, block_bytes),
        GroupLayout((layer_name(1),), WINDOW, block_bytes),
    )
    with pytest.raises(ValueError, match=r"one block size .* group 0 has 4, the engine 8"):
        group_layouts(hybrid_kv_config(8, BLOCK_SIZE, WINDOW), 8)
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32")
    mamba = MambaSpec(block_size=4, shapes=((4,),), dtypes=("float32",))
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["m"], mamba)],
    )
    with pytest.raises(ValueError, match="group 1 is MambaSpec"):
        group_layouts(config, 4)


def test_layer_groups_must_name_every_layer_once() -> None:
    assert check_layer_groups(["a", "b"], [["b"], [], ["a"]]) == [["b"], [], ["a"]]
    with pytest.raises(ValueError, match="in KV cache groups 0 and 1"):
        check_layer_groups(["a"], [["a"], ["a"]])
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['c'\]"):
        check_layer_groups(["a", "b"], [["a", "c"]])
    with pytest.raises(ValueError, match="kv_cache_groups has 1 layouts"):
        KVConnectorContext(
            block_size=BLOCK_SIZE, num_kv_cache_groups=2, kv_cache_groups=(GroupLayout(("a",)),)
        )


# ------------------------------------------------------------------ shared storage
def _storage_pair(path: Path) -> tuple[SharedStorageConnector, SharedStorageConnector]:
    cfg = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(path)},
    )
    ctx = hybrid_context(BLOCK_SIZE, WINDOW)
    return (
        SharedStorageConnector(cfg, KVConnectorRole.SCHEDULER, ctx),
        SharedStorageConnector(cfg, KVConnectorRole.WORKER, ctx),
    )


def test_shared_storage_round_trips_both_groups_and_the_window_only(tmp_path: Path) -> None:
    sched_side, worker_side = _storage_pair(tmp_path)
    sched = _scheduler(sched_side)
    sim = KVWorkerSim(
        worker_side,
        make_kv_caches(NUM_BLOCKS, BLOCK_SIZE),
        BLOCK_SIZE,
        layer_groups=HYBRID_LAYER_GROUPS,
    )
    prompt = list(range(10, 31))  # 21 tokens: a prefix of 20 (5 blocks)
    sched.add_request(make_request("a", prompt, max_tokens=2))
    _run(sched, sim)
    rank_dir = tmp_path / prefix_key(prompt[:20], []) / "rank0"
    stored: dict[str, tuple[int, int]] = {}
    for layer in (0, 1):
        with safetensors.safe_open(str(rank_dir / f"{layer_name(layer)}.safetensors"), "pt") as f:
            first = int((f.metadata() or {})["first_token"])
            stored[layer_name(layer)] = (first, f.get_tensor("kv_cache").shape[1])
    # Full layer: all 20 tokens; sliding layer: blocks 3 and 4 (tokens 12..19) only,
    # the window of a resume at token 20 (tokens 15..19).
    assert stored == {layer_name(0): (0, 20), layer_name(1): (12, 8)}

    assert sched.reset_prefix_cache()
    for cache in sim.kv_caches.values():
        cache.zero_()
    sched.add_request(make_request("b", prompt, max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20
    # The sliding group's table holds null blocks before the window.
    sliding_ids = so.scheduled_new_reqs[0].block_ids[1]
    assert sliding_ids[:3] == [0, 0, 0] and 0 not in sliding_ids[3:]
    out = sim.execute(so)
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == []
    _assert_window_kv(sim, "b", prompt, 20)
    assert sim.computed_positions["b"] == [20]
    sched.update_from_output(so, out)


# ------------------------------------------------------------------ offloading
CHUNK = 8  # two blocks
PROMPT = list(range(10, 37))  # 27 tokens: chunks 0..2 full, a hit ends at token 24


class _OffloadEngine:
    def __init__(
        self, budget: int = 2048, chunk: int = CHUNK, extra: dict[str, object] | None = None
    ) -> None:
        tiers = extra if extra is not None else {"kv_bytes_per_rank": 1 << 20}
        cfg = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"chunk_size": chunk, **tiers},
        )
        ctx = hybrid_context(BLOCK_SIZE, WINDOW)
        self.sched_side = OffloadingConnector(cfg, KVConnectorRole.SCHEDULER, ctx)
        self.worker_side = OffloadingConnector(cfg, KVConnectorRole.WORKER, ctx)
        self.sched = _scheduler(self.sched_side, budget)
        self.sim = KVWorkerSim(
            self.worker_side,
            make_kv_caches(NUM_BLOCKS, BLOCK_SIZE),
            BLOCK_SIZE,
            layer_groups=HYBRID_LAYER_GROUPS,
        )

    def run(self, rid: str, prompt: list[int]) -> None:
        self.sched.add_request(make_request(rid, prompt, max_tokens=1))
        _run(self.sched, self.sim)
        self.worker_side.worker_side.writer.flush()

    def forget_device_cache(self) -> None:
        assert self.sched.reset_prefix_cache()
        for cache in self.sim.kv_caches.values():
            cache.zero_()

    def host_keys(self) -> set[str]:
        host = self.sched_side.scheduler_side.host
        assert host is not None
        return set(host.keys_lru_first())


def _chunk_keys(prompt: list[int]) -> list[ChunkKey]:
    """The chunk keys the engines compute for `prompt` (hash seed 0, as `_scheduler`)."""
    _scheduler(None)  # sets this process's NONE_HASH from hash_seed 0
    req = Request.from_engine_core_request(
        make_request("probe", prompt),
        max_model_len=256,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    return chunk_keys(req.block_hashes, CHUNK // BLOCK_SIZE)


def test_offloading_serves_both_groups_from_the_host_tier_after_eviction() -> None:
    engine = _OffloadEngine()
    engine.run("a", PROMPT)
    keys = _chunk_keys(PROMPT)
    full = {group_chunk_key(k, 0) for k in keys}
    # The sliding group stores only the chunks near the prompt's end (window + one chunk):
    # chunk 0 (tokens 0..7) can serve no resume of this prompt.
    sliding = {group_chunk_key(k, 1) for k in keys[1:]}
    assert engine.host_keys() == full | sliding
    # Each group's chunks are announced with its group index (CPU medium).
    stored = [e for e in engine.sched_side.take_events() if isinstance(e, BlockStored)]
    assert sorted(e.group_idx or 0 for e in stored) == [0, 0, 0, 1, 1]

    engine.forget_device_cache()
    engine.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = engine.sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    assert so.kv_connector_metadata is not None
    meta = msgspec.msgpack.decode(so.kv_connector_metadata, type=OffloadingMetadata)
    loaded = {(load.group, load.key, len(load.block_ids)) for load in meta.loads}
    # Full group: every block of chunks 0..2; sliding group: blocks 4 and 5 (tokens
    # 16..23 hold the window 19..23 of token 24), i.e. chunk 2 only.
    assert loaded == {(0, keys[0], 2), (0, keys[1], 2), (0, keys[2], 2), (1, keys[2] + "_g1", 2)}
    out = engine.sim.execute(so)
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == []
    _assert_window_kv(engine.sim, "b", PROMPT, 24)
    assert engine.sim.computed_positions["b"] == [24, 25, 26]
    engine.sched.update_from_output(so, out)
    engine.worker_side.shutdown()


def test_offloading_a_chunked_prefill_saves_the_sliding_window_as_it_is_computed() -> None:
    # 3 tokens a step: the sliding group's older blocks are freed while the prompt is
    # still being computed; the chunks it saves must hold the KV of their tokens.
    engine = _OffloadEngine(budget=3)
    engine.run("a", PROMPT)
    keys = _chunk_keys(PROMPT)
    assert group_chunk_key(keys[2], 1) in engine.host_keys()
    engine.forget_device_cache()
    engine.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = engine.sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    out = engine.sim.execute(so)
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == []
    _assert_window_kv(engine.sim, "b", PROMPT, 24)
    engine.sched.update_from_output(so, out)
    engine.worker_side.shutdown()


def test_offloading_never_saves_sliding_blocks_freed_during_the_prefill() -> None:
    # Chunk 16 (4 blocks), 3 tokens a step: when chunk 0's last token is computed (step
    # starting at token 15), its blocks 0 and 1 already left the 6-token window and were
    # freed (maybe reused): the sliding group must not save chunk 0 (the full one does).
    engine = _OffloadEngine(budget=3, chunk=16)
    engine.run("a", PROMPT)
    req = Request.from_engine_core_request(
        make_request("probe", PROMPT),
        max_model_len=256,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    (key,) = chunk_keys(req.block_hashes, 4)
    assert engine.host_keys() == {key}
    engine.worker_side.shutdown()


def test_offloading_disk_tier_finds_every_groups_chunks_after_a_restart(tmp_path: Path) -> None:
    first = _OffloadEngine(extra={"disk_path": str(tmp_path)})
    first.run("a", PROMPT)
    first.worker_side.shutdown()
    keys = _chunk_keys(PROMPT)
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {f"{k}.kvchunk" for k in keys} | {f"{k}_g1.kvchunk" for k in keys[1:]}
    # A new engine on the same directory announces what it found, per group.
    second = _OffloadEngine(extra={"disk_path": str(tmp_path)})
    found = [e for e in second.sched_side.take_events() if isinstance(e, BlockStored)]
    assert sorted(e.group_idx or 0 for e in found) == [0, 0, 0, 1, 1]
    second.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = second.sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    out = second.sim.execute(so)
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == []
    _assert_window_kv(second.sim, "b", PROMPT, 24)
    second.sched.update_from_output(so, out)
    second.worker_side.shutdown()


def test_offloading_hit_ends_where_every_group_holds_its_chunks() -> None:
    engine = _OffloadEngine()
    engine.run("a", PROMPT)
    keys = _chunk_keys(PROMPT)
    # The sliding group's window chunk for a resume at 24 is gone: 16 is the longest
    # end whose window (blocks 2..3, chunk 1) the sliding group still holds.
    host = engine.sched_side.scheduler_side.host
    assert host is not None and host.remove(group_chunk_key(keys[2], 1))
    engine.forget_device_cache()
    engine.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = engine.sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    out = engine.sim.execute(so)
    _assert_window_kv(engine.sim, "b", PROMPT, 16)
    assert engine.sim.computed_positions["b"] == list(range(16, 27))
    engine.sched.update_from_output(so, out)
    engine.worker_side.shutdown()


# ------------------------------------------------------------------ P/D (kv/p2p)
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _PDEngine:
    def __init__(self, role: str) -> None:
        cfg = KVTransferConfig(
            kv_connector="PagedZmqConnector",
            kv_role=role,  # type: ignore[arg-type]
            kv_connector_extra_config={
                "side_channel_host": "127.0.0.1",
                "side_channel_port": _free_port(),
                "transfer_timeout": 5.0,
            },
        )
        ctx = hybrid_context(BLOCK_SIZE, WINDOW, model_name="m")
        self.sched_side = PagedZmqConnector(cfg, KVConnectorRole.SCHEDULER, ctx)
        self.worker_side = PagedZmqConnector(cfg, KVConnectorRole.WORKER, ctx)
        self.sched = _scheduler(self.sched_side)
        self.sim = KVWorkerSim(
            self.worker_side,
            make_kv_caches(NUM_BLOCKS, BLOCK_SIZE),
            BLOCK_SIZE,
            layer_groups=HYBRID_LAYER_GROUPS,
        )
        self.outputs: dict[str, list[EngineCoreOutput]] = {}
        self.stats: dict[str, float] = {}

    def step(self) -> None:
        so = self.sched.schedule()
        for per_client in self.sched.update_from_output(so, self.sim.execute(so)).values():
            if per_client.scheduler_stats is not None:
                for k, v in per_client.scheduler_stats.kv_connector_stats.items():
                    self.stats[k] = self.stats.get(k, 0.0) + v
            for out in per_client.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)

    def finished(self, rid: str) -> EngineCoreOutput | None:
        done = [o for o in self.outputs.get(rid, []) if o.finish_reason is not None]
        return done[-1] if done else None


def _run_until(engines: list[_PDEngine], done: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for engine in engines:
            engine.step()
        if callable(done) and done():
            return
    raise AssertionError("timed out")


def test_pd_decoder_pulls_every_group_and_only_the_sliding_window() -> None:
    p, d = _PDEngine("kv_producer"), _PDEngine("kv_consumer")
    try:
        req = make_request("p1", PROMPT, max_tokens=1)
        p.sched.add_request(
            msgspec.structs.replace(req, kv_transfer_params=KVTransferParams(do_remote_decode=True))
        )
        _run_until([p], lambda: p.finished("p1") is not None)
        out = p.finished("p1")
        assert out is not None and out.kv_transfer_params is not None
        params = out.kv_transfer_params
        # vLLM's hybrid form: one block list per group (7 blocks cover 27 tokens).
        assert params.remote_block_ids is None and params.extra is not None
        groups = params.extra["remote_block_ids"]
        assert [len(ids) for ids in groups] == [7, 7]

        d.sched.add_request(
            msgspec.structs.replace(
                make_request("d1", PROMPT, max_tokens=4), kv_transfer_params=params
            )
        )
        _run_until([p, d], lambda: d.finished("d1") is not None and p.sched.state.kv.usage == 0.0)
        n = len(PROMPT)
        # Only the last prompt token and the decoded ones were computed on the decoder.
        assert d.sim.computed_positions["d1"] == list(range(n - 1, n + 3))
        _assert_window_kv(d.sim, "d1", PROMPT, n - 1)
        final = d.sched.make_stats()
        if final is not None:
            for k, v in final.kv_connector_stats.items():
                d.stats[k] = d.stats.get(k, 0.0) + v
        # Full group: blocks 0..6; sliding group: blocks 5 and 6 (the window of token 26).
        layer_block_bytes = 2 * BLOCK_SIZE * 2 * 4 * 4
        assert d.stats["p2p.recv_bytes"] == (7 + 2) * layer_block_bytes
        d.sched.check_integrity()
        p.sched.check_integrity()
    finally:
        p.worker_side.shutdown()
        d.worker_side.shutdown()


def test_pd_decoder_computes_locally_when_the_prefill_lost_the_window() -> None:
    # A prefill that decoded past its prompt freed its oldest window blocks (the null
    # block, id 0, in its table): pulling them would load garbage, so no pull.
    d = _PDEngine("kv_consumer")
    try:
        params = KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id="e",
            remote_request_id="x",
            remote_host="127.0.0.1",
            remote_port=_free_port(),
            extra={"remote_block_ids": [[1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 0, 8]]},
        )
        d.sched.add_request(
            msgspec.structs.replace(
                make_request("d1", PROMPT, max_tokens=2), kv_transfer_params=params
            )
        )
        d.step()
        assert d.sched.state.requests["d1"].status is not RequestStatus.WAITING_FOR_REMOTE_KVS
        _run_until([d], lambda: d.finished("d1") is not None)
        assert d.sim.computed_positions["d1"] == list(range(len(PROMPT) + 1))
    finally:
        d.worker_side.shutdown()


def test_offloading_refuses_layerwise_for_a_hybrid_model_at_start_up() -> None:
    # The layer-wise copies index one chunk over every layer; a hybrid model's chunks hold
    # one group's layers each, so the combination is refused when the caches register.
    with pytest.raises(ValueError, match="use_layerwise needs a model with one KV cache group"):
        _OffloadEngine(extra={"kv_bytes_per_rank": 1 << 20, "use_layerwise": True})


def test_redis_tier_carries_both_groups_between_two_engines() -> None:
    # Engine A computes the prompt and writes each group's chunks to Redis (the sliding
    # group only those near the prompt's end); engine B, which never saw it, loads the
    # full group's chunks and the sliding group's window from Redis and resumes at 24.
    with RedisServer() as server:
        extra: dict[str, object] = {
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [{"type": "redis", "url": server.url, "read_timeout_s": 2.0}],
        }
        a = _OffloadEngine(extra=extra)
        a.run("a", PROMPT)
        writer = a.worker_side.worker_side.redis_writer
        assert writer is not None
        writer.flush()
        stored = redis.Redis.from_url(server.url).keys("paged:kv:*")
        assert len(stored) == 5  # 3 full-group chunks + 2 sliding-group chunks

        b = _OffloadEngine(extra=extra)
        b.sched.add_request(make_request("b", PROMPT, max_tokens=1))
        so = b.sched.schedule()
        assert so.scheduled_new_reqs[0].num_computed_tokens == 24
        assert so.kv_connector_metadata is not None
        meta = msgspec.msgpack.decode(so.kv_connector_metadata, type=OffloadingMetadata)
        keys = _chunk_keys(PROMPT)
        loaded = {(load.group, load.key, load.source) for load in meta.loads}
        assert loaded == {
            (0, keys[0], Tier.REDIS), (0, keys[1], Tier.REDIS), (0, keys[2], Tier.REDIS),
            (1, keys[2] + "_g1", Tier.REDIS),
        }  # fmt: skip
        out = b.sim.execute(so)
        assert out.kv_connector_output is not None
        assert out.kv_connector_output.invalid_block_ids == []
        _assert_window_kv(b.sim, "b", PROMPT, 24)
        b.sched.update_from_output(so, out)
        for engine in (a, b):
            engine.worker_side.shutdown()
            engine.sched_side.shutdown()
