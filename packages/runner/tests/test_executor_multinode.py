"""The multi-node mp executor's pieces without worker processes: config checks, node layout,
the node link's handshake and liveness (a raw ZMQ DEALER plays the remote node), and a
headless agent that node 0 refuses or never answers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.runner.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerLimits,
)
from paged.runner.executor.abstract import WorkerDiedError, WorkerError
from paged.runner.executor.messages import CheckHealth, ExecuteModel, Reply
from paged.runner.executor.multiproc import worker_threads
from paged.runner.executor.node_agent import run_worker_node
from paged.runner.executor.node_wire import (
    KIND_CALL,
    Fingerprint,
    Heartbeat,
    Hello,
    LinkTimeouts,
    NodeFailed,
    NodeReady,
    NodeReply,
    Welcome,
    control_frames,
    decode_control,
    free_port_pair,
    link_endpoint,
)
from paged.runner.executor.rank_layout import node_ranks
from paged.runner.executor.remote_nodes import RemoteNodes
from paged.runner.executor.replies import results_in_rank_order
from paged.scheduler.boundary import SchedulerOutput

FAST = LinkTimeouts(join_s=2.0, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.8)


def two_nodes(port: int = 29501, **kw: object) -> ParallelConfig:
    fields: dict[str, object] = {
        "tensor_parallel_size": 2,
        "nnodes": 2,
        "master_addr": "127.0.0.1",
        "master_port": port,
    }
    fields.update(kw)
    return ParallelConfig(**fields)  # type: ignore[arg-type]


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nnodes": 0}, "nnodes: must be >= 1"),
        ({"node_rank": 2}, r"node_rank: must be in \[0, 2\)"),
        ({"tensor_parallel_size": 3}, "nnodes: 2 does not divide the world size 3"),
        ({"distributed_executor_backend": "ray"}, "need distributed_executor_backend 'mp'"),
        ({"master_addr": None}, "master_addr: required with nnodes > 1"),
        ({"master_port": 65535}, "master_port: must be in 1..65534"),
    ],
)
def test_parallel_config_refuses_bad_node_settings(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        two_nodes(29501, **fields)


def test_one_node_needs_no_master_addr() -> None:
    assert ParallelConfig(tensor_parallel_size=2).ranks_per_node == 2


def test_ranks_are_laid_out_node_major() -> None:
    config = two_nodes(pipeline_parallel_size=2)  # tp 2 x pp 2 over 2 nodes
    assert [list(node_ranks(config, n)) for n in range(2)] == [[0, 1], [2, 3]]
    assert config.ranks_per_node == 2
    four = two_nodes(pipeline_parallel_size=2, nnodes=4)
    assert [list(node_ranks(four, n)) for n in range(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="node_rank"):
        node_ranks(config, 2)


def test_link_endpoint_is_one_port_above_master_port() -> None:
    assert link_endpoint("localhost", 4000) == "tcp://127.0.0.1:4001"
    with pytest.raises(ValueError, match="master_addr: cannot resolve"):
        link_endpoint("no-such-host.invalid", 4000)


def test_link_timeouts_checks_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="join_s: must be > 0"):
        LinkTimeouts(join_s=0)
    with pytest.raises(ValueError, match="must exceed heartbeat_interval_s"):
        LinkTimeouts(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.0)
    monkeypatch.setenv("PAGED_NODE_JOIN_TIMEOUT_S", "7")
    monkeypatch.setenv("PAGED_NODE_HEARTBEAT_TIMEOUT_S", "3.5")
    assert LinkTimeouts.from_env() == LinkTimeouts(join_s=7.0, heartbeat_timeout_s=3.5)
    monkeypatch.setenv("PAGED_NODE_JOIN_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="PAGED_NODE_JOIN_TIMEOUT_S: must be a number"):
        LinkTimeouts.from_env()


def test_worker_threads_share_the_nodes_cores_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGED_WORKER_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert [worker_threads(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("PAGED_WORKER_NUM_THREADS", "3")
    assert worker_threads(2) == 3
    monkeypatch.setenv("PAGED_WORKER_NUM_THREADS", "0")
    with pytest.raises(ValueError, match="PAGED_WORKER_NUM_THREADS: must be an integer >= 1"):
        worker_threads(2)


def test_results_keep_rank_order_and_empty_slots_for_trimmed_ranks() -> None:
    call = CheckHealth()
    replies = [Reply(2, msgspec.msgpack.encode(None)), Reply(0, msgspec.msgpack.encode(None))]
    assert results_in_rank_order(call, replies, 4) == [None, None, None, None]
    with pytest.raises(WorkerError, match="worker 3: boom"):
        results_in_rank_order(call, [*replies, Reply(3, error="boom")], 4)


# -------------------------------------------------------------- node link


def fingerprint(**kw: object) -> Fingerprint:
    fields: dict[str, object] = {
        "world_size": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "nnodes": 2,
        "architecture": "LlamaForCausalLM", "num_hidden_layers": 2, "vocab_size": 128,
        "dtype": "float32", "device_type": "cpu", "max_model_len": 64, "block_size": 4,
        "max_num_seqs": 4, "max_num_batched_tokens": 12, "seed": 0,
    }  # fmt: skip
    fields.update(kw)
    return Fingerprint(**fields)  # type: ignore[arg-type]


@pytest.fixture
def node0() -> Iterator[RemoteNodes]:
    link = RemoteNodes(two_nodes(free_port_pair()), fingerprint(), output_rank=0, timeouts=FAST)
    yield link
    link.close()


class FakeNode:
    """A raw DEALER playing node 1's agent."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, message: Hello | NodeReady | NodeReply | NodeFailed | Heartbeat) -> None:
        self.sock.send_multipart(control_frames(message))

    def recv(self, timeout_s: float = 5.0) -> list[bytes]:
        assert self.sock.poll(int(timeout_s * 1000)), "nothing from node 0"
        frames: list[bytes] = self.sock.recv_multipart()
        return frames

    def recv_control(self) -> object:
        while True:
            kind, *rest = self.recv()
            if kind != KIND_CALL:
                message = decode_control(rest[0])
                if not isinstance(message, Heartbeat):
                    return message

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def fake_node(node0: RemoteNodes) -> Iterator[Callable[[], FakeNode]]:
    made: list[FakeNode] = []

    def make() -> FakeNode:
        made.append(FakeNode(node0.endpoint))
        return made[-1]

    yield make
    for node in made:
        node.close()


def test_node0_refuses_a_node_with_other_settings(
    node0: RemoteNodes, fake_node: Callable[[], FakeNode]
) -> None:
    node = fake_node()
    node.send(Hello(1, 123, "h1", fingerprint(block_size=16)))
    welcome = node.recv_control()
    assert isinstance(welcome, Welcome)
    assert welcome.error == "its settings differ from node 0's: block_size: 4 here vs 16 there"
    other = fake_node()
    other.send(Hello(5, 124, "h5", fingerprint()))
    refused = other.recv_control()
    assert isinstance(refused, Welcome) and refused.error == "node_rank 5 is not in 1..1"
    with pytest.raises(TimeoutError, match=r"node\(s\) \[1\] never joined"):
        node0.wait_joined(time.monotonic() + 0.5)


def test_calls_reach_the_node_and_its_replies_come_back_in_order(
    node0: RemoteNodes, fake_node: Callable[[], FakeNode]
) -> None:
    node = fake_node()
    node.send(Hello(1, 123, "h1", fingerprint()))
    welcome = node.recv_control()
    assert isinstance(welcome, Welcome) and welcome.error is None and welcome.output_rank == 0
    node.send(NodeReady(1))
    node0.wait_joined(time.monotonic() + 5)
    node0.wait_ready(time.monotonic() + 5)
    payload = msgspec.msgpack.encode(ExecuteModel(SchedulerOutput()))
    node0.send_call(payload, output_rank_only=True)
    while (frames := node.recv())[0] != KIND_CALL:
        pass
    assert frames[1:] == [b"\x01", payload]
    node.send(NodeReply(1, [Reply(1, error="bad")]))
    node.send(NodeReply(1, []))
    assert node0.collect(time.monotonic() + 5) == [Reply(1, error="bad")]
    assert node0.collect(time.monotonic() + 5) == []
    with pytest.raises(TimeoutError, match="node 1 did not answer in time"):
        node0.collect(time.monotonic() + 0.3)
    node.send(NodeFailed(1, "worker 1 (pid 9) on node 1 died with exit code -9"))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            node0.check_alive()
        except WorkerDiedError as exc:
            assert str(exc) == "node 1 (h1): worker 1 (pid 9) on node 1 died with exit code -9"
            break
        time.sleep(0.05)
    else:
        raise AssertionError("NodeFailed was not noticed")


@pytest.mark.parametrize("how", ["silent", "closed"])
def test_a_silent_or_vanished_node_fails_the_link_within_seconds(
    node0: RemoteNodes, fake_node: Callable[[], FakeNode], how: str
) -> None:
    node = fake_node()
    node.send(Hello(1, 123, "h1", fingerprint()))
    node.recv_control()
    start = time.monotonic()
    if how == "closed":
        node.sock.close()
    with pytest.raises(WorkerDiedError, match=r"node 1 \(h1, agent pid 123\) is gone: ") as info:
        while time.monotonic() - start < 5.0:
            node0.check_alive()
            time.sleep(0.05)
    assert time.monotonic() - start < 3.0
    assert ("connection closed" if how == "closed" else "heartbeat timeout") in str(info.value)


# ------------------------------------------------------------- headless side


@pytest.fixture
def tiny_config(tiny_checkpoint: Callable[..., Path]) -> Callable[..., EngineConfig]:
    model = ModelConfig.from_pretrained(str(tiny_checkpoint("llama")), max_model_len=64)

    def build(port: int, block_size: int = 4) -> EngineConfig:
        return EngineConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=block_size, kv_cache_memory_bytes=1 << 20),
            parallel_config=two_nodes(port, node_rank=1),
            scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=12),
        )

    return build


def test_headless_node_exits_1_when_node0_never_answers(
    tiny_config: Callable[..., EngineConfig], caplog: pytest.LogCaptureFixture
) -> None:
    start = time.monotonic()
    assert run_worker_node(tiny_config(free_port_pair()), LinkTimeouts(join_s=1.0)) == 1
    assert time.monotonic() - start < 10.0
    assert "node 0 did not answer at tcp://127.0.0.1:" in caplog.text


def test_headless_node_exits_1_when_node0_refuses_it(
    tiny_config: Callable[..., EngineConfig], caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port_pair()
    node0_config = tiny_config(port)
    node0_fp = Fingerprint.of(node0_config)
    link = RemoteNodes(node0_config.parallel_config, node0_fp, output_rank=0, timeouts=FAST)
    try:
        assert run_worker_node(tiny_config(port, block_size=8), FAST) == 1
    finally:
        link.close()
    assert "node 0 refused this node: its settings differ from node 0's: block_size" in caplog.text


def test_run_worker_node_is_only_for_nodes_above_0(
    tiny_config: Callable[..., EngineConfig],
) -> None:
    config = tiny_config(29501)
    node0 = EngineConfig(
        config.model_config,
        config.cache_config,
        two_nodes(29501, node_rank=0),
        config.scheduler_limits,
    )
    with pytest.raises(ValueError, match="node_rank: a headless worker node has node_rank >= 1"):
        run_worker_node(node0)


@settings(max_examples=60, deadline=None)
@given(tp=st.integers(1, 8), pp=st.integers(1, 8), nnodes=st.integers(1, 8))
def test_nodes_partition_the_world_in_rank_order(tp: int, pp: int, nnodes: int) -> None:
    world = tp * pp
    if world % nnodes:
        with pytest.raises(ValueError, match="does not divide the world size"):
            two_nodes(tensor_parallel_size=tp, pipeline_parallel_size=pp, nnodes=nnodes)
        return
    config = two_nodes(tensor_parallel_size=tp, pipeline_parallel_size=pp, nnodes=nnodes)
    ranges = [node_ranks(config, n) for n in range(nnodes)]
    assert [r for nr in ranges for r in nr] == list(range(world))  # node-major, no gaps
    assert {len(nr) for nr in ranges} == {config.ranks_per_node}
    if pp % nnodes == 0:  # whole stages per node: every TP group stays on one node
        node_of = {r: n for n, nr in enumerate(ranges) for r in nr}
        for stage in range(pp):
            assert len({node_of[stage * tp + t] for t in range(tp)}) == 1
