"""ECZmqConnector, both roles: a producer worker and a consumer (scheduler side + worker
side) joined by loopback ZMQ, the consumer writing into a preallocated cache."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import pytest
import torch

from paged.connectors.ec import (
    ECConnectorContext,
    ECConnectorFactory,
    ECConnectorRole,
    ECConnectorRoleError,
    ECTransferConfig,
)
from paged.connectors.ec.p2p.connector import ECZmqConnector, ECZmqLoad, ECZmqMetadata
from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from paged.scheduler.boundary import SchedulerOutput
from paged.scheduler.request import Request
from paged.scheduler.testing import make_request

HIDDEN = 8


class RowCache:
    """A fixed `[capacity, HIDDEN]` buffer with bump allocation: the EncoderCache contract."""

    def __init__(self, capacity: int = 256) -> None:
        self.buffer = torch.zeros(capacity, HIDDEN)
        self.runs: dict[str, tuple[int, int]] = {}
        self.next = 0

    @property
    def hidden_size(self) -> int:
        return HIDDEN

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self.runs

    def get(self, mm_hash: str) -> torch.Tensor | None:
        run = self.runs.get(mm_hash)
        return None if run is None else self.buffer[run[0] : run[0] + run[1]]

    def allocate(self, mm_hash: str, num_embeds: int) -> torch.Tensor:
        if mm_hash in self.runs:
            raise ValueError(f"{mm_hash} already present")
        if self.next + num_embeds > self.buffer.shape[0]:
            raise RuntimeError("full")
        self.runs[mm_hash] = (self.next, num_embeds)
        self.next += num_embeds
        return self.buffer[self.next - num_embeds : self.next]

    def free(self, mm_hash: str) -> None:
        self.runs.pop(mm_hash, None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def image_request(rid: str, hashes: list[str], embeds: int = 4) -> Request:
    mm = [
        MultiModalFeatureSpec(
            "image", h, PlaceholderRange(offset=2 + i * (embeds + 2), length=embeds)
        )
        for i, h in enumerate(hashes)
    ]
    return Request.from_engine_core_request(make_request(rid, 40, mm=mm), max_model_len=256)


def config(role: str, **extra: object) -> ECTransferConfig:
    return ECTransferConfig(
        ec_connector="ECZmqConnector", ec_role=role, ec_connector_extra_config=dict(extra)
    )


@dataclass
class Pair:
    producer: ECZmqConnector  # worker side
    consumer_sched: ECZmqConnector
    consumer_worker: ECZmqConnector
    producer_cache: RowCache
    consumer_cache: RowCache

    def consumer_step(self, meta: ECZmqMetadata) -> tuple[set[str], set[str]]:
        """One consumer worker step: bind, start loads, report (finished, failed)."""
        worker = self.consumer_worker

        worker.bind_connector_metadata(msgspec.msgpack.encode(meta))
        worker.start_load_caches(self.consumer_cache)
        _, recving = worker.get_finished(set())
        failed = worker.get_failed_loads()
        worker.clear_connector_metadata()
        return recving or set(), failed

    def wait_loads(
        self, meta: ECZmqMetadata, n: int, timeout: float = 10.0
    ) -> tuple[set[str], set[str]]:
        done: set[str] = set()
        failed: set[str] = set()
        step_meta = meta
        deadline = time.monotonic() + timeout
        while len(done) + len(failed) < n:
            assert time.monotonic() < deadline, f"{len(done) + len(failed)} of {n} loads"
            d, f = self.consumer_step(step_meta)
            step_meta = ECZmqMetadata()
            done |= d
            failed |= f
        return done, failed


@pytest.fixture
def pair() -> Iterator[Pair]:
    port = free_port()
    ctx = ECConnectorContext()
    producer = ECZmqConnector(
        config("ec_producer", listen_port=port, hold_timeout=30), ECConnectorRole.WORKER, ctx
    )
    consumer_cfg = config(
        "ec_consumer", producer_endpoints=[f"127.0.0.1:{port}"], transfer_timeout=1.0
    )
    sched = ECZmqConnector(consumer_cfg, ECConnectorRole.SCHEDULER, ctx)
    worker = ECZmqConnector(consumer_cfg, ECConnectorRole.WORKER, ctx)
    p = Pair(producer, sched, worker, RowCache(), RowCache())
    producer.register_caches(p.producer_cache)
    worker.register_caches(p.consumer_cache)
    yield p
    for c in (producer, sched, worker):
        c.shutdown()


def encode_on_producer(p: Pair, mm_hash: str, value: torch.Tensor) -> None:
    p.producer_cache.allocate(mm_hash, value.shape[0]).copy_(value)
    p.producer.save_caches(p.producer_cache, mm_hash)


def test_factory_knows_the_connector_by_name() -> None:
    factory = ECConnectorFactory.with_builtins()
    assert "ECZmqConnector" in factory.registered_names()
    cfg = config("ec_consumer", producer_endpoints=["127.0.0.1:1"])
    conn = factory.create_connector(cfg, ECConnectorRole.SCHEDULER, ECConnectorContext())
    assert isinstance(conn, ECZmqConnector)
    assert conn.has_cache_item("x") and conn.is_async_load("x")


def test_loads_land_in_the_registered_cache_and_free_the_producer(pair: Pair) -> None:
    a, b = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    encode_on_producer(pair, "img-a", a)
    encode_on_producer(pair, "img-b", b)
    server = pair.producer.server
    assert server is not None and server.num_held() == 2
    req = image_request("r1", ["img-a", "img-b"])
    pair.consumer_sched.update_state_after_alloc(req, 0)
    pair.consumer_sched.update_state_after_alloc(req, 1)
    meta = pair.consumer_sched.build_connector_meta(SchedulerOutput())
    assert [(ld.mm_hash, ld.num_embeds) for ld in meta.loads] == [("img-a", 4), ("img-b", 4)]
    # Per-step state is reset.
    assert pair.consumer_sched.build_connector_meta(SchedulerOutput()).loads == []
    done, failed = pair.wait_loads(meta, 2)
    assert done == {"img-a", "img-b"} and failed == set()
    got_a, got_b = pair.consumer_cache.get("img-a"), pair.consumer_cache.get("img-b")
    assert got_a is not None and torch.equal(got_a, a)
    assert got_b is not None and torch.equal(got_b, b)
    # Written into the preallocated buffer itself, not a tensor of its own.
    assert got_a.data_ptr() == pair.consumer_cache.buffer.data_ptr()
    assert pair.consumer_worker.bytes_received == 2 * 4 * HIDDEN * 4
    # The ACKs free the producer's copies; finished_sending reports them.
    deadline = time.monotonic() + 5
    sending: set[str] = set()
    while sending != {"img-a", "img-b"}:
        assert time.monotonic() < deadline
        s, _ = pair.producer.get_finished(set())
        sending |= s or set()
    assert server.num_held() == 0


def test_a_hash_asked_twice_is_fetched_once(pair: Pair) -> None:
    encode_on_producer(pair, "same", torch.ones(4, HIDDEN))
    req1, req2 = image_request("r1", ["same"]), image_request("r2", ["same"])
    pair.consumer_sched.update_state_after_alloc(req1, 0)
    pair.consumer_sched.update_state_after_alloc(req2, 0)
    meta = pair.consumer_sched.build_connector_meta(SchedulerOutput())
    done, _ = pair.wait_loads(meta, 1)
    assert done == {"same"}
    server = pair.producer.server
    assert server is not None
    time.sleep(0.2)
    assert server.counters.served == 1 and server.counters.not_found == 0


def test_missing_and_mismatched_outputs_are_failed_loads(pair: Pair) -> None:
    encode_on_producer(pair, "wide", torch.ones(4, HIDDEN))
    meta = ECZmqMetadata(loads=[ECZmqLoad("never-encoded", 4), ECZmqLoad("wide", 5)])
    done, failed = pair.wait_loads(meta, 2)
    assert done == set() and failed == {"never-encoded", "wide"}
    # No rows stay reserved for a failed load.
    assert "wide" not in pair.consumer_cache and "never-encoded" not in pair.consumer_cache
    assert pair.consumer_worker.num_load_failures == 2


def test_a_dead_producer_fails_the_load_within_the_timeout() -> None:
    port = free_port()  # nothing listens there
    cfg = config("ec_consumer", producer_endpoints=[f"127.0.0.1:{port}"], transfer_timeout=0.5)
    worker = ECZmqConnector(cfg, ECConnectorRole.WORKER, ECConnectorContext())
    cache = RowCache()
    worker.register_caches(cache)
    try:
        start = time.monotonic()
        worker.bind_connector_metadata(msgspec.msgpack.encode(ECZmqMetadata([ECZmqLoad("h", 4)])))
        worker.start_load_caches(cache)
        failed: set[str] = set()
        while not failed:
            assert time.monotonic() - start < 5
            worker.get_finished(set())
            failed = worker.get_failed_loads()
        assert failed == {"h"} and time.monotonic() - start < 3
    finally:
        worker.shutdown()


def test_roles_and_config_errors() -> None:
    ctx = ECConnectorContext()
    sched = ECZmqConnector(
        config("ec_consumer", producer_endpoints=["127.0.0.1:1"]), ECConnectorRole.SCHEDULER, ctx
    )
    with pytest.raises(ECConnectorRoleError):
        sched.start_load_caches(RowCache())
    # vLLM 0.33: a consumer starts without producers; requests name them.
    bare = ECZmqConnector(config("ec_consumer"), ECConnectorRole.SCHEDULER, ctx)
    assert not bare.has_cache_item("x")
    assert not bare.has_cache_item("x", image_request("r", ["x"]))
    announced = image_request("r", ["x"])
    announced.ec_transfer_params = {"x": {"peer_host": "10.0.0.9", "peer_port": 5701}}
    assert bare.has_cache_item("x", announced)
    assert not bare.has_cache_item("y", announced)
    bare.update_state_after_alloc(announced, 0)
    (load,) = bare.build_connector_meta(SchedulerOutput()).loads
    assert load.endpoints == ["tcp://10.0.0.9:5701"]
    producer_sched = ECZmqConnector(config("ec_producer"), ECConnectorRole.SCHEDULER, ctx)
    # A producer never loads: every item is encoded (and saved) there.
    assert not producer_sched.has_cache_item("x")
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        ECZmqConnector(config("ec_producer", bogus=1), ECConnectorRole.SCHEDULER, ctx)


def test_a_producer_delays_the_free_of_requests_with_images() -> None:
    ctx = ECConnectorContext()
    sched = ECZmqConnector(
        config("ec_producer", listen_port=5710, advertise_host="enc-0"),
        ECConnectorRole.SCHEDULER,
        ctx,
    )
    # Its answer names where each item is held (vLLM 0.33's ec_transfer_params).
    entry = {"modality": "image", "metadata": {}, "peer_host": "enc-0", "peer_port": 5710}
    assert sched.request_finished(image_request("r", ["h", "g", "h"])) == (
        True,
        {"h": {**entry, "item_indices": [0, 2]}, "g": {**entry, "item_indices": [1]}},
    )
    text_only = Request.from_engine_core_request(make_request("t", 8), max_model_len=256)
    assert sched.request_finished(text_only) == (False, None)
    consumer = ECZmqConnector(
        config("ec_consumer", producer_endpoints=["127.0.0.1:1"]), ECConnectorRole.SCHEDULER, ctx
    )
    assert consumer.request_finished(image_request("r", ["h"])) == (False, None)


def test_a_consumer_without_endpoints_fetches_from_the_announced_producer(pair: Pair) -> None:
    ctx = ECConnectorContext()
    cfg = config("ec_consumer", transfer_timeout=1.0)
    sched = ECZmqConnector(cfg, ECConnectorRole.SCHEDULER, ctx)
    worker = ECZmqConnector(cfg, ECConnectorRole.WORKER, ctx)
    cache = RowCache()
    worker.register_caches(cache)
    pair.consumer_worker, pair.consumer_cache = worker, cache
    try:
        value = torch.randn(4, HIDDEN)
        encode_on_producer(pair, "img-a", value)
        # The producer's own answer, as the proxy forwards it.
        producer_sched = ECZmqConnector(
            pair.producer.ec_transfer_config, ECConnectorRole.SCHEDULER, ctx
        )
        _, params = producer_sched.request_finished(image_request("enc", ["img-a"]))
        req = image_request("r1", ["img-a", "img-dead"])
        dead = {"peer_host": "127.0.0.1", "peer_port": free_port()}
        req.ec_transfer_params = {**(params or {}), "img-dead": dead}
        assert sched.has_cache_item("img-a", req) and sched.has_cache_item("img-dead", req)
        sched.update_state_after_alloc(req, 0)
        sched.update_state_after_alloc(req, 1)
        done, failed = pair.wait_loads(sched.build_connector_meta(SchedulerOutput()), 2)
        # The announced producer's item landed; the one from an absent producer is a
        # failed load, which the scheduler encodes locally (ec_load_failure_policy).
        assert done == {"img-a"} and failed == {"img-dead"}
        got = cache.get("img-a")
        assert got is not None and torch.equal(got, value)
    finally:
        sched.shutdown()
        worker.shutdown()
