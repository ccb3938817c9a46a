"""ECZmqConnector transport: the wire, the producer's server and the consumer's fetcher
over loopback ZMQ (no engine)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from paged.connectors.ec.p2p import (
    ECZmqConfig,
    EmbeddingFetcher,
    EmbeddingServer,
    FetchResult,
    wire,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(fetcher: EmbeddingFetcher, n: int, timeout: float = 10.0) -> list[FetchResult]:
    results: list[FetchResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < n and time.monotonic() < deadline:
        results.extend(fetcher.collect())
        time.sleep(0.005)
    assert len(results) == n, f"{len(results)} of {n} fetches finished"
    return results


def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.fixture
def pair() -> Iterator[tuple[EmbeddingServer, EmbeddingFetcher, ECZmqConfig]]:
    port = free_port()
    config = ECZmqConfig(
        listen_port=port, producer_endpoints=(f"tcp://127.0.0.1:{port}",), transfer_timeout=2.0
    )
    server = EmbeddingServer(config)
    fetcher = EmbeddingFetcher(config)
    yield server, fetcher, config
    fetcher.close()
    server.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_wire_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    t = torch.randn(7, 5).to(dtype)
    header = wire.EmbeddingHeader(3, "h", list(t.shape), wire.dtype_name(t.dtype))
    encoded = wire.ENCODER.encode(header)
    back = wire.HEADER_DECODER.decode(encoded)
    assert back == header
    assert (
        wire.tensor_from_bytes(back, bytes(wire.tensor_bytes(t)))
        .view(torch.uint8)
        .equal(t.view(torch.uint8))
    )


def test_wire_rejects_bad_sizes_and_dtypes() -> None:
    header = wire.EmbeddingHeader(1, "h", [2, 3], "float32")
    with pytest.raises(ValueError, match="24 expected"):
        wire.tensor_from_bytes(header, b"\0" * 20)
    with pytest.raises(ValueError, match="unknown embedding dtype 'nope'"):
        wire.tensor_from_bytes(wire.EmbeddingHeader(1, "h", [1], "nope"), b"\0")
    # The wire layout is positional (array_like): pinned so both ends agree.
    assert wire.ENCODER.encode(wire.FetchRequest(5, "ab")) == b"\x92\x05\xa2ab"


def test_fetch_delivers_the_held_output_and_ack_frees_it(
    pair: tuple[EmbeddingServer, EmbeddingFetcher, ECZmqConfig],
) -> None:
    server, fetcher, _ = pair
    out = torch.randn(16, 8)
    server.put("img-1", out)
    assert server.num_held() == 1 and server.held_bytes() == 16 * 8 * 4
    fetcher.submit("img-1")
    (result,) = wait_for(fetcher, 1)
    assert result.error is None and result.output is not None
    assert torch.equal(result.output, out)
    assert result.num_bytes == 16 * 8 * 4
    until(lambda: server.num_held() == 0)
    assert server.take_freed() == {"img-1"}
    assert server.counters.acknowledged == 1 and server.counters.served == 1
    stats = server.take_stats()
    assert stats["ec_p2p.send_transfers"] == 1 and stats["ec_p2p.send_bytes"] == 512
    # Acknowledged outputs are gone: a second fetch is an error naming the hash.
    fetcher.submit("img-1")
    (again,) = wait_for(fetcher, 1)
    assert again.output is None and again.error is not None
    assert "img-1 is not held" in again.error


def test_a_hash_in_flight_is_fetched_once(
    pair: tuple[EmbeddingServer, EmbeddingFetcher, ECZmqConfig],
) -> None:
    server, fetcher, _ = pair
    server.put("x", torch.ones(2, 2))
    for _ in range(5):
        fetcher.submit("x")
    results = wait_for(fetcher, 1)
    time.sleep(0.2)
    assert len(results) + len(fetcher.collect()) == 1
    assert server.counters.served + server.counters.not_found == 1


def test_unfetched_outputs_are_freed_after_hold_timeout() -> None:
    server = EmbeddingServer(ECZmqConfig(listen_port=free_port(), hold_timeout=0.2))
    try:
        server.put("a", torch.zeros(3))
        assert server.take_freed() == set()
        time.sleep(0.3)
        assert server.take_freed() == {"a"}
        assert server.num_held() == 0 and server.counters.expired == 1
    finally:
        server.close()


def test_a_dead_producer_fails_the_fetch_within_the_timeout_then_a_new_one_serves() -> None:
    port = free_port()
    config = ECZmqConfig(
        listen_port=port, producer_endpoints=(f"127.0.0.1:{port}",), transfer_timeout=0.5
    )
    fetcher = EmbeddingFetcher(config)
    try:
        start = time.monotonic()
        fetcher.submit("gone")
        (result,) = wait_for(fetcher, 1)
        assert result.output is None and result.error is not None
        assert "within 0.5 s (transfer_timeout)" in result.error
        assert time.monotonic() - start < 3.0
        # A producer (re)started on the same port is used by the next fetch.
        server = EmbeddingServer(config)
        try:
            server.put("back", torch.arange(4.0))
            fetcher.submit("back")
            (ok,) = wait_for(fetcher, 1)
            assert ok.output is not None and torch.equal(ok.output, torch.arange(4.0))
        finally:
            server.close()
    finally:
        fetcher.close()


def test_two_producers_the_holder_answers() -> None:
    ports = [free_port(), free_port()]
    servers = [EmbeddingServer(ECZmqConfig(listen_port=p)) for p in ports]
    fetcher = EmbeddingFetcher(
        ECZmqConfig(producer_endpoints=tuple(f"127.0.0.1:{p}" for p in ports))
    )
    try:
        servers[1].put("only-on-1", torch.full((2, 3), 7.0))
        fetcher.submit("only-on-1")
        (result,) = wait_for(fetcher, 1)
        assert result.output is not None and float(result.output[0, 0]) == 7.0
        until(lambda: servers[1].num_held() == 0)
        assert servers[0].counters.not_found == 1
        fetcher.submit("nowhere")
        (missing,) = wait_for(fetcher, 1)
        assert missing.error is not None and missing.error.count("is not held") == 2
    finally:
        fetcher.close()
        for s in servers:
            s.close()


def test_config_keys_and_errors() -> None:
    cfg = ECZmqConfig.from_extra_config(
        {"producer_endpoints": ["localhost:6000", "tcp://10.0.0.1:6001"], "listen_port": 6100}
    )
    assert cfg.producer_endpoints == ("tcp://localhost:6000", "tcp://10.0.0.1:6001")
    assert cfg.listen_endpoint == "tcp://127.0.0.1:6100"
    assert ECZmqConfig.from_extra_config({"producer_endpoints": "h:1"}).producer_endpoints == (
        "tcp://h:1",
    )
    with pytest.raises(ValueError, match="unknown key 'listen_prot'"):
        ECZmqConfig.from_extra_config({"listen_prot": 1})
    with pytest.raises(ValueError, match="producer_endpoints: 'nohost' is not host:port"):
        ECZmqConfig.from_extra_config({"producer_endpoints": ["nohost"]})
    with pytest.raises(ValueError, match="transfer_timeout must be positive"):
        ECZmqConfig.from_extra_config({"transfer_timeout": 0})
    with pytest.raises(ValueError, match="listen_port: expected a number"):
        ECZmqConfig.from_extra_config({"listen_port": True})
    # The host a producer announces as peer_host (vLLM 0.33's ec_transfer_params).
    assert ECZmqConfig(listen_host="10.1.2.3").peer_host == "10.1.2.3"
    assert ECZmqConfig.from_extra_config({"advertise_host": "enc-0"}).peer_host == "enc-0"
    assert ECZmqConfig(listen_host="0.0.0.0").peer_host not in ("0.0.0.0", "")


def test_a_fetcher_without_producers_asks_the_announced_one_or_fails_at_once() -> None:
    # No producer_endpoints (vLLM 0.33): each fetch names its producer.
    port = free_port()
    server = EmbeddingServer(ECZmqConfig(listen_port=port))
    fetcher = EmbeddingFetcher(ECZmqConfig(transfer_timeout=5.0))
    try:
        server.put("held", torch.arange(3.0))
        fetcher.submit("held", [f"tcp://127.0.0.1:{port}"])
        (ok,) = wait_for(fetcher, 1)
        assert ok.output is not None and torch.equal(ok.output, torch.arange(3.0))
        start = time.monotonic()
        fetcher.submit("unannounced")
        (nowhere,) = wait_for(fetcher, 1)
        assert nowhere.error is not None and "no producer known" in nowhere.error
        assert time.monotonic() - start < 2.0  # not a transfer_timeout wait
    finally:
        fetcher.close()
        server.close()


def test_port_in_use_is_a_clear_error() -> None:
    port = free_port()
    first = EmbeddingServer(ECZmqConfig(listen_port=port))
    try:
        with pytest.raises(ValueError, match="listen_port to a free port"):
            EmbeddingServer(ECZmqConfig(listen_port=port))
    finally:
        first.close()


def test_a_hash_put_twice_is_freed_with_its_last_reference(
    pair: tuple[EmbeddingServer, EmbeddingFetcher, ECZmqConfig],
) -> None:
    server, fetcher, _ = pair
    server.put("twice", torch.ones(2))
    server.put("twice", torch.ones(2))
    fetcher.submit("twice")
    wait_for(fetcher, 1)
    until(lambda: server.counters.acknowledged == 1)
    # One reference released (reported), the copy kept for the second one.
    assert server.take_freed() == {"twice"} and server.holds("twice")
    fetcher.submit("twice")
    (again,) = wait_for(fetcher, 1)
    assert again.output is not None
    until(lambda: not server.holds("twice"))
    assert server.take_freed() == {"twice"}
