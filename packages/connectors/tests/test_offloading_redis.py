"""The Redis tier over real redis-server processes, real Schedulers and real KV tensors.

Two engines (two schedulers, two simulated workers) share one private server
started on a free port per test: engine A computes and writes a prompt's
chunks, engine B finds them and loads them. Every fault (server killed,
restarted, slowed, full, a corrupt or foreign value, a peer answering
garbage) must end in a recompute with the right KV, counted by reason, with
no block leaked.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch

from paged.connectors.kv import KVConnectorContext, KVConnectorRole, KVTransferConfig
from paged.connectors.kv.offloading import OffloadingConnector
from paged.connectors.kv.offloading.chunks import chunk_keys
from paged.connectors.kv.offloading.config import OffloadingConfig
from paged.connectors.kv.offloading.redis_client import Backoff, parse_redis_tier
from paged.connectors.kv.offloading.redis_server import RedisServer
from paged.connectors.kv.offloading.redis_tier import RedisKeyspace
from paged.connectors.kv.testing import (
    HEAD_SIZE,
    NUM_HEADS,
    NUM_LAYERS,
    KVWorkerSim,
    expected_kv,
    make_kv_caches,
)
from paged.kvcache import BlockStored, get_request_block_hasher, sha256
from paged.scheduler.boundary import ModelRunnerOutput, SchedulerOutput
from paged.scheduler.request import Request
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import BLOCK_SIZE, free_blocks, make_request, make_scheduler

NUM_BLOCKS = 48
CHUNK = 8  # two blocks of 4
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_HEADS * HEAD_SIZE * 4
PROMPT = list(range(10, 37))  # 27 tokens: three full chunks (24 loadable tokens) and three
OTHER = list(range(40, 67))  # another prompt of the same shape


def _extra(url: str, **tier: Any) -> dict[str, Any]:
    return {
        "chunk_size": CHUNK,
        "spec_name": "TieringOffloadingSpec",
        "secondary_tiers": [
            {"type": "redis", "url": url, "read_timeout_s": 0.3, "enable_kv_events": True, **tier}
        ],
    }


class _Engine:
    """A scheduler and a simulated worker with only the Redis tier."""

    def __init__(
        self, extra: dict[str, Any], model: str = "m", dtype: torch.dtype = torch.float32
    ) -> None:
        cfg = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
        ctx = KVConnectorContext(
            block_size=BLOCK_SIZE, kv_bytes_per_block=BLOCK_BYTES, model_name=model
        )
        self.sched_side = OffloadingConnector(cfg, KVConnectorRole.SCHEDULER, ctx)
        self.worker_side = OffloadingConnector(cfg, KVConnectorRole.WORKER, ctx)
        self.sched: Scheduler = make_scheduler(
            NUM_BLOCKS, kv_connector=self.sched_side, enable_kv_cache_events=True
        )
        caches = {k: v.to(dtype) for k, v in make_kv_caches(NUM_BLOCKS, BLOCK_SIZE).items()}
        self.sim = KVWorkerSim(self.worker_side, caches, BLOCK_SIZE)
        self.free_at_start = free_blocks(self.sched)
        self.stats: dict[str, float] = {}
        self.computed: dict[str, int] = {}  # request -> tokens found in a tier at admission
        self.kv: dict[str, dict[str, torch.Tensor]] = {}  # request -> its last KV seen
        self.prompts: dict[str, list[int]] = {}

    def run(self, rid: str, prompt: list[int] = PROMPT) -> None:
        self.prompts[rid] = prompt
        self.sched.add_request(make_request(rid, prompt, max_tokens=2))
        for _ in range(100):
            if not self.sched.has_requests():
                self.flush()
                return
            so = self.sched.schedule()
            for new in so.scheduled_new_reqs:
                self.computed[new.req_id] = new.num_computed_tokens
            self.step(so)
        raise AssertionError("did not finish")

    def step(self, so: SchedulerOutput, out: ModelRunnerOutput | None = None) -> None:
        out = self.sim.execute(so) if out is None else out
        for rid in self.sim.reqs:  # the KV of its first 24 tokens, before it is freed
            self.kv[rid] = self.sim.kv_of(rid, 24)
        for outputs in self.sched.update_from_output(so, out).values():
            if outputs.scheduler_stats is not None:
                for name, value in outputs.scheduler_stats.kv_connector_stats.items():
                    self.stats[name] = self.stats.get(name, 0.0) + value

    def flush(self) -> None:
        writer = self.worker_side.worker_side.redis_writer
        assert writer is not None
        writer.flush()
        # What the writer counted after the last step's report.
        for name, value in (self.worker_side.get_kv_connector_stats() or {}).items():
            self.stats[name] = self.stats.get(name, 0.0) + value

    def assert_kv(self, rid: str) -> None:
        """The request's first 24 tokens of KV are the prompt's (loaded or recomputed)."""
        loaded = self.kv[rid]
        for name, kv in expected_kv(self.prompts[rid], 24).items():
            torch.testing.assert_close(loaded[name], kv.to(loaded[name].dtype), rtol=0, atol=0)

    def assert_no_leak(self) -> None:
        assert self.sched.reset_prefix_cache()
        assert free_blocks(self.sched) == self.free_at_start

    def close(self) -> None:
        self.worker_side.shutdown()
        self.sched_side.shutdown()


def _keys() -> list[str]:
    make_scheduler(NUM_BLOCKS)  # this process's NONE_HASH, as the engines have it
    req = Request.from_engine_core_request(
        make_request("probe", PROMPT),
        max_model_len=256,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    return list(chunk_keys(req.block_hashes, CHUNK // BLOCK_SIZE))


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def _stored_in_redis(srv: RedisServer) -> list[bytes]:
    keys: list[bytes] = redis.Redis.from_url(srv.url).keys("paged:kv:*")  # type: ignore[assignment]
    return sorted(keys)


# ------------------------------------------------------------------- round trip
def test_engine_b_loads_what_engine_a_computed(server: RedisServer) -> None:
    a = _Engine(_extra(server.url))
    a.run("a")
    assert a.computed["a"] == 0
    assert len(_stored_in_redis(server)) == 3  # three chunks, rank 0
    assert a.stats["redis.bytes_saved"] > 3 * CHUNK * BLOCK_BYTES // BLOCK_SIZE
    b = _Engine(_extra(server.url))
    b.run("b")
    assert b.computed["b"] == 24  # every loadable token came from Redis
    b.assert_kv("b")
    assert b.stats["redis.hits"] == 24 and b.stats["redis.queries"] == 24
    assert b.stats["redis.bytes_loaded"] == 3 * CHUNK * BLOCK_BYTES // BLOCK_SIZE
    # B's events say which tier served the prompt: the Redis tier, remote storage.
    served = [
        e
        for e in b.sched.take_kv_cache_events()
        if isinstance(e, BlockStored) and e.ownership == "redis"
    ]
    assert [(e.medium, e.locality, e.token_ids) for e in served] == [
        ("STORAGE", "REMOTE", PROMPT[0:8]),
        ("STORAGE", "REMOTE", PROMPT[8:16]),
        ("STORAGE", "REMOTE", PROMPT[16:24]),
    ]
    assert "redis.bytes_saved" not in b.stats  # found in Redis: not written again
    b.assert_no_leak()
    a.close()
    b.close()


def test_two_models_on_one_redis_never_serve_each_others_kv(server: RedisServer) -> None:
    a = _Engine(_extra(server.url), model="model-a")
    a.run("a")
    other = _Engine(_extra(server.url), model="model-b")  # same layout, another model
    other.run("b")
    assert other.computed["b"] == 0 and "redis.hits" not in other.stats
    # Same name, another layout (float16 KV): the keys collide, the value's fingerprint
    # does not match, so the load fails and the request recomputes.
    half = _Engine(_extra(server.url), model="model-a", dtype=torch.float16)
    half.run("c")
    assert half.stats["redis.read_corrupt"] >= 1 and half.stats["load_errors"] >= 1
    half.assert_kv("c")
    half.assert_no_leak()
    for engine in (a, other, half):
        engine.close()


def test_a_corrupt_value_is_recomputed_and_written_again(server: RedisServer) -> None:
    a = _Engine(_extra(server.url))
    a.run("a")
    client = redis.Redis.from_url(server.url)
    space = RedisKeyspace.of(parse_redis_tier({"url": server.url}), "m", BLOCK_SIZE, CHUNK, 1)
    name = space.key(_keys()[1], 0)  # type: ignore[arg-type]
    value = client.get(name)
    assert isinstance(value, bytes)
    client.setrange(name, len(value) - 5, b"\xff")  # one payload byte
    b = _Engine(_extra(server.url))
    b.run("b")
    assert b.stats["redis.read_corrupt"] == 1 and b.stats["load_errors"] == 1
    b.assert_kv("b")  # recomputed from the bad chunk on: the right KV
    b.assert_no_leak()
    assert client.get(name) == value  # the recomputed chunk overwrote the bad one
    c = _Engine(_extra(server.url))
    c.run("c")
    assert c.computed["c"] == 24 and "load_errors" not in c.stats
    for engine in (a, b, c):
        engine.close()


# ------------------------------------------------------------------------ faults
def test_a_killed_then_restarted_server_costs_recomputes_only(server: RedisServer) -> None:
    a = _Engine(_extra(server.url, backoff_max_s=0.2))
    a.run("a")
    server.kill()
    b = _Engine(_extra(server.url, backoff_max_s=0.2))
    start = time.monotonic()
    b.run("b")  # the lookup fails fast (refused): computed here
    assert time.monotonic() - start < 5
    assert b.computed["b"] == 0 and b.stats["redis.lookup_down"] >= 1
    assert b.stats.get("redis.write_down", 0) + b.stats.get("redis.write_backoff", 0) == 3
    b.assert_kv("b")
    b.assert_no_leak()
    server.start()  # same port, empty: what was stored is gone
    time.sleep(0.3)  # past the backoff
    b.run("b2", OTHER)  # b reconnected: its lookup misses, its writes land
    assert b.computed["b2"] == 0 and len(_stored_in_redis(server)) == 3
    c = _Engine(_extra(server.url))
    c.run("c", OTHER)
    assert c.computed["c"] == 24 and "redis.lookup_down" not in c.stats
    c.run("c-again")  # what A stored went with the restart: recomputed
    assert c.computed["c-again"] == 0
    for engine in (a, b, c):
        engine.close()


def test_a_server_killed_between_lookup_and_load_is_a_recompute(server: RedisServer) -> None:
    a = _Engine(_extra(server.url))
    a.run("a")
    b = _Engine(_extra(server.url))
    b.prompts["b"] = PROMPT
    b.sched.add_request(make_request("b", PROMPT, max_tokens=2))
    so = b.sched.schedule()  # the lookup found all three chunks
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    server.kill()
    out = b.sim.execute(so)  # the loads find no server
    assert out.kv_connector_output is not None
    assert len(out.kv_connector_output.invalid_block_ids) == 6
    b.step(so, out)
    b.run("b-next")  # runs b to its end as well
    assert b.stats["redis.read_down"] >= 1 and b.stats["load_errors"] == 3
    b.assert_kv("b")
    b.assert_no_leak()
    assert b.worker_side.get_kv_connector_stats() is not None
    a.close()
    b.close()


def test_a_slow_server_misses_the_deadline_and_the_step_goes_on(server: RedisServer) -> None:
    a = _Engine(_extra(server.url))
    a.run("a")
    client = redis.Redis.from_url(server.url)
    sleeper = threading.Thread(
        target=lambda: client.execute_command("DEBUG", "SLEEP", "5")  # type: ignore[no-untyped-call]
    )
    sleeper.start()
    time.sleep(0.5)  # the server is now asleep for ~5 s
    b = _Engine(_extra(server.url))
    start = time.monotonic()
    b.sched.add_request(make_request("b", PROMPT, max_tokens=2))
    b.sched.schedule()
    assert time.monotonic() - start < 3  # the 0.3 s read deadline, not 5 s (slack: CI load)
    assert b.sched_side.scheduler_side.take_stats()["redis.lookup_timeout"] == 1
    sleeper.join()
    b.close()
    a.close()


def test_writes_to_a_paused_server_are_dropped_never_waited_for(server: RedisServer) -> None:
    engine = _Engine(_extra(server.url, write_timeout_s=0.3, max_pending_writes=1))
    writer = engine.worker_side.worker_side.redis_writer
    assert writer is not None
    redis.Redis.from_url(server.url).client_pause(5000, all=False)  # writes wait 5 s
    chunk = torch.zeros(2, NUM_LAYERS, 2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    start = time.monotonic()
    offered = [writer.offer(f"{i:064x}", chunk) for i in range(20)]  # type: ignore[arg-type]
    assert time.monotonic() - start < 1.0  # offer never waits for the paused server
    assert offered.count(False) >= 18  # one in flight, one queued, the rest dropped
    writer.flush()
    stats = engine.worker_side.get_kv_connector_stats() or {}
    assert stats["redis.write_queue_full"] == offered.count(False)
    assert stats.get("redis.write_timeout", 0) + stats.get("redis.write_backoff", 0) == (
        offered.count(True)
    )
    engine.close()


def test_a_full_server_refuses_writes_which_are_counted() -> None:
    # noeviction: past maxmemory every SET is an OOM error.
    with RedisServer("--maxmemory-policy", "noeviction") as srv:
        client = redis.Redis.from_url(srv.url)
        client.set("filler", b"x" * 1_000_000)
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used - 100_000)  # full now
        engine = _Engine(_extra(srv.url))
        engine.run("a")
        assert engine.stats["redis.write_oom"] == 3
        assert "redis.bytes_saved" not in engine.stats
        engine.assert_kv("a")
        engine.assert_no_leak()
        engine.close()


def test_a_peer_answering_garbage_is_a_miss() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"?not redis\r\n")

    threading.Thread(target=serve, daemon=True).start()
    engine = _Engine(_extra(f"redis://127.0.0.1:{port}"))
    engine.run("a")
    assert engine.computed["a"] == 0
    assert engine.stats["redis.lookup_garbage"] == 1
    engine.assert_kv("a")
    engine.assert_no_leak()
    engine.close()
    listener.close()


# ------------------------------------------------------------------------ config
def test_the_redis_tier_alone_or_below_disk_is_accepted() -> None:
    alone = OffloadingConfig.from_extra_config(_extra("redis://h:1"), BLOCK_SIZE)
    assert alone.redis is not None and alone.redis.url == "redis://h:1"
    assert not alone.has_host and not alone.has_disk
    both = OffloadingConfig.from_extra_config(
        {
            "cpu_bytes_to_use": 1 << 20,
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [
                {"type": "fs", "root_dir": "/tmp/kv"},
                {"type": "redis", "url": "redis://h:1", "namespace": "fleet", "ttl_s": 600},
            ],
        },
        BLOCK_SIZE,
    )
    assert both.has_host and both.has_disk and both.redis is not None
    assert (both.redis.namespace, both.redis.ttl_s) == ("fleet", 600)


@pytest.mark.parametrize(
    ("tier", "match"),
    [
        ({"url": "http://h:1"}, "needs url"),
        ({}, "needs url"),
        ({"url": "redis://h:1", "password": "x"}, r"keys \['password'\]"),
        ({"url": "redis://h:1", "read_timeout_s": 0}, "read_timeout_s must be a number > 0"),
        ({"url": "redis://h:1", "max_pending_writes": 1.5}, "max_pending_writes must be an"),
        ({"url": "redis://h:1", "namespace": "a b"}, "namespace"),
        ({"url": "redis://h:1", "enable_kv_events": "yes"}, "enable_kv_events"),
    ],
)
def test_bad_redis_tier_keys_name_the_key(tier: dict[str, Any], match: str) -> None:
    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [{"type": "redis", **tier}]}
    with pytest.raises(ValueError, match=match):
        OffloadingConfig.from_extra_config(extra, BLOCK_SIZE)


def test_tier_order_is_disk_then_redis() -> None:
    tiers = [{"type": "redis", "url": "redis://h:1"}, {"type": "fs", "root_dir": "/tmp/kv"}]
    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": tiers}
    with pytest.raises(ValueError, match=r"secondary_tiers \['redis', 'fs'\] is not supported"):
        OffloadingConfig.from_extra_config(extra, BLOCK_SIZE)


def test_backoff_doubles_up_to_its_cap_and_resets() -> None:
    now = [0.0]
    backoff = Backoff(0.5, clock=lambda: now[0])
    assert backoff.ready()
    for delay in (0.1, 0.2, 0.4, 0.5, 0.5):
        backoff.failed()
        now[0] += delay - 0.01
        assert not backoff.ready()
        now[0] += 0.02
        assert backoff.ready()
    backoff.succeeded()
    assert backoff.ready()
