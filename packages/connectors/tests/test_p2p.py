"""PagedZmqConnector: two schedulers with real KV tensors, connected over loopback ZMQ."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import pytest
import torch

from paged.connectors.kv import KVConnectorContext, KVConnectorRole, KVTransferConfig
from paged.connectors.kv.p2p import (
    KVHandshakeError,
    KVLayoutInfo,
    PagedZmqConnector,
    ZmqConnectorConfig,
    check_compatible,
)
from paged.connectors.kv.testing import KVWorkerSim, expected_kv, make_kv_caches
from paged.scheduler.boundary import EngineCoreOutput, EngineCoreRequest, KVTransferParams
from paged.scheduler.connectors import KVConnectorScheduler
from paged.scheduler.remote_kv import add_counters
from paged.scheduler.request import RequestStatus
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import BLOCK_SIZE, make_request, make_scheduler

NUM_BLOCKS = 64
_SCHEDULER_SIDE: type[KVConnectorScheduler] = PagedZmqConnector


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Engine:
    sched: Scheduler
    sim: KVWorkerSim
    scheduler_side: PagedZmqConnector
    worker_side: PagedZmqConnector
    outputs: dict[str, list[EngineCoreOutput]]
    stats: dict[str, float] = field(default_factory=dict)

    def step(self) -> None:
        so = self.sched.schedule()
        for per_client in self.sched.update_from_output(so, self.sim.execute(so)).values():
            if per_client.scheduler_stats is not None:
                add_counters(self.stats, per_client.scheduler_stats.kv_connector_stats)
            for out in per_client.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)

    def finished(self, rid: str) -> EngineCoreOutput | None:
        done = [o for o in self.outputs.get(rid, []) if o.finish_reason is not None]
        return done[-1] if done else None

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_token_ids]

    @property
    def usage(self) -> float:
        return self.sched.state.kv.usage


def make_engine(
    role: str,
    port: int,
    *,
    model: str = "m",
    policy: str = "recompute",
    **extra: object,
) -> Engine:
    config = KVTransferConfig(
        kv_connector="PagedZmqConnector",
        kv_role=role,  # type: ignore[arg-type]
        kv_load_failure_policy=policy,  # type: ignore[arg-type]
        kv_connector_extra_config={
            "side_channel_host": "127.0.0.1",
            "side_channel_port": port,
            "transfer_timeout": 1.0,
            **extra,
        },
    )
    ctx = KVConnectorContext(block_size=BLOCK_SIZE, model_name=model)
    sched_side = PagedZmqConnector(config, KVConnectorRole.SCHEDULER, ctx)
    worker_side = PagedZmqConnector(config, KVConnectorRole.WORKER, ctx)
    sched = make_scheduler(
        NUM_BLOCKS, kv_connector=sched_side, kv_load_failure_policy=policy, max_model_len=512
    )
    sim = KVWorkerSim(worker_side, make_kv_caches(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)
    return Engine(sched, sim, sched_side, worker_side, {})


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.worker_side.shutdown()


def run_until(engines: list[Engine], done: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for engine in engines:
            engine.step()
        if callable(done) and done():
            return
    raise AssertionError("timed out")


PROMPT = list(range(10, 10 + 3 * BLOCK_SIZE + 3))  # 3 full blocks and 3 tokens


def prefill(engine: Engine, rid: str = "p1", prompt: list[int] = PROMPT) -> KVTransferParams:
    req = make_request(rid, prompt, max_tokens=1)
    engine.sched.add_request(
        msgspec.structs.replace(req, kv_transfer_params=KVTransferParams(do_remote_decode=True))
    )
    run_until([engine], lambda: engine.finished(rid) is not None)
    out = engine.finished(rid)
    assert out is not None and out.kv_transfer_params is not None
    return out.kv_transfer_params


def decode_request(
    rid: str, params: KVTransferParams, prompt: list[int] = PROMPT
) -> EngineCoreRequest:
    return msgspec.structs.replace(
        make_request(rid, prompt, max_tokens=4), kv_transfer_params=params
    )


def test_prefill_returns_nixl_style_params_and_holds_blocks(engines: list[Engine]) -> None:
    port = free_port()
    p = make_engine("kv_producer", port)
    engines.append(p)
    params = prefill(p)
    assert params.do_remote_prefill and not params.do_remote_decode
    assert params.remote_engine_id == p.scheduler_side.engine_id
    assert params.remote_request_id == "p1"
    assert params.remote_host == "127.0.0.1" and params.remote_port == port
    assert params.remote_block_ids is not None and len(params.remote_block_ids) == 4
    assert params.extra == {"tp_size": 1}
    assert p.usage > 0  # held for the decoder (delay_free)


def test_decode_pulls_blocks_then_prefill_frees_them(engines: list[Engine]) -> None:
    port = free_port()
    p = make_engine("kv_producer", port)
    d = make_engine("kv_consumer", free_port())
    engines += [p, d]
    params = prefill(p)
    d.sched.add_request(decode_request("d1", params))
    d.step()
    assert d.sched.state.requests["d1"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    run_until([p, d], lambda: d.finished("d1") is not None and p.usage == 0.0)
    # Only the last prompt token and the decoded ones were computed on the decoder.
    n = len(PROMPT)
    assert d.sim.computed_positions["d1"] == list(range(n - 1, n + 3))
    got = d.sim.kv_of("d1", n - 1)
    want = expected_kv(PROMPT, n - 1)
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    for engine in (p, d):
        final = engine.sched.make_stats()
        if final is not None:
            add_counters(engine.stats, final.kv_connector_stats)
    # 3 full blocks + the partial one, 2 layers of [2, B, 2 heads, 4] fp32
    block_bytes = 2 * BLOCK_SIZE * 2 * 4 * 4
    assert d.stats["p2p.recv_transfers"] == 1
    assert d.stats["p2p.recv_bytes"] == 4 * 2 * block_bytes
    assert d.stats["p2p.recv_seconds"] > 0
    assert d.stats.get("p2p.requests_waiting_for_remote_kv", 0) == 0  # +1 then -1
    assert p.stats["p2p.send_transfers"] == 1
    assert p.stats["p2p.send_bytes"] == 4 * 2 * block_bytes
    d.sched.check_integrity()
    p.sched.check_integrity()


def test_decoder_keeps_stepping_others_while_pulling(engines: list[Engine]) -> None:
    # A prefill that never answers: the pull waits (up to transfer_timeout) while
    # another request on the decoder runs to completion.
    dead = free_port()
    d = make_engine("kv_consumer", free_port(), transfer_timeout=3.0)
    engines.append(d)
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="e",
        remote_request_id="x",
        remote_block_ids=[1, 2, 3, 4],
        remote_host="127.0.0.1",
        remote_port=dead,
    )
    d.sched.add_request(decode_request("remote", params))
    d.sched.add_request(make_request("local", list(range(5, 20)), max_tokens=3))
    start = time.monotonic()
    run_until([d], lambda: d.finished("local") is not None)
    assert time.monotonic() - start < 2.0
    assert d.finished("remote") is None
    assert d.sched.state.requests["remote"].status is RequestStatus.WAITING_FOR_REMOTE_KVS


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_dead_prefill_fails_or_recomputes_within_the_timeout(
    engines: list[Engine], policy: str
) -> None:
    d = make_engine("kv_consumer", free_port(), policy=policy)
    engines.append(d)
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id="gone",
        remote_request_id="x",
        remote_block_ids=[1, 2, 3, 4],
        remote_host="127.0.0.1",
        remote_port=free_port(),
    )
    d.sched.add_request(decode_request("d1", params))
    start = time.monotonic()
    run_until([d], lambda: d.finished("d1") is not None, timeout=5.0)
    assert time.monotonic() - start < 3.0  # transfer_timeout is 1 s
    out = d.finished("d1")
    assert out is not None
    if policy == "fail":
        assert out.finish_reason is not None and out.finish_reason.name == "ERROR"
    else:
        assert len(d.tokens("d1")) == 4
        assert d.sim.computed_positions["d1"][0] == 0  # the whole prompt recomputed
    run_until([d], lambda: d.usage == 0.0 or not d.sched.has_requests(), timeout=2)
    d.sched.check_integrity()


def test_abort_timeout_frees_blocks_nobody_pulls(engines: list[Engine]) -> None:
    p = make_engine("kv_producer", free_port(), abort_request_timeout=0.3)
    engines.append(p)
    prefill(p)
    assert p.usage > 0
    start = time.monotonic()
    run_until([p], lambda: p.usage == 0.0, timeout=3.0)
    assert 0.25 < time.monotonic() - start < 2.0
    p.sched.check_integrity()


def test_partial_delivery_keeps_the_valid_prefix(engines: list[Engine]) -> None:
    p = make_engine("kv_producer", free_port())
    d = make_engine("kv_consumer", free_port())
    engines += [p, d]
    params = prefill(p)
    assert params.remote_block_ids is not None
    # The prefill holds the first two of the blocks asked for: it sends those.
    bad = msgspec.structs.replace(
        params, remote_block_ids=[*params.remote_block_ids[:2], NUM_BLOCKS - 1, NUM_BLOCKS - 2]
    )
    d.sched.add_request(decode_request("d1", bad))
    run_until([p, d], lambda: d.finished("d1") is not None and p.usage == 0.0)
    n = len(PROMPT)
    assert d.sim.computed_positions["d1"] == list(range(2 * BLOCK_SIZE, n + 3))
    want = expected_kv(PROMPT, n)
    got = d.sim.kv_of("d1", n)
    for name in want:
        torch.testing.assert_close(got[name], want[name])


def test_abort_while_pulling_frees_both_sides(engines: list[Engine]) -> None:
    p = make_engine("kv_producer", free_port())
    d = make_engine("kv_consumer", free_port())
    engines += [p, d]
    params = prefill(p)
    d.sched.add_request(decode_request("d1", params))
    d.step()  # admitted, pull started
    d.sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    run_until([p, d], lambda: d.usage == 0.0 and p.usage == 0.0, timeout=3.0)
    assert not d.sched.has_requests() or d.sched.get_num_unfinished_requests() == 0


def test_abort_before_admission_releases_the_prefill_early(engines: list[Engine]) -> None:
    p = make_engine("kv_producer", free_port())
    d = make_engine("kv_consumer", free_port())
    engines += [p, d]
    params = prefill(p)
    d.sched.add_request(decode_request("d1", params))
    d.sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)  # never scheduled
    start = time.monotonic()
    run_until([p, d], lambda: p.usage == 0.0, timeout=3.0)
    assert time.monotonic() - start < 2.0  # not the 480 s abort timeout


def test_handshake_mismatch_fails_the_load_naming_the_field(engines: list[Engine]) -> None:
    p = make_engine("kv_producer", free_port(), model="model-a")
    d = make_engine("kv_consumer", free_port(), model="model-b", policy="fail")
    engines += [p, d]
    params = prefill(p)
    d.sched.add_request(decode_request("d1", params))
    run_until([p, d], lambda: d.finished("d1") is not None, timeout=5.0)
    out = d.finished("d1")
    assert out is not None and out.finish_reason is not None
    assert out.finish_reason.name == "ERROR"


def _info(**changes: object) -> KVLayoutInfo:
    base = KVLayoutInfo(
        engine_id="e",
        model="m",
        dtype="float32",
        block_size=16,
        kv_layout="2x16x2x4",
        num_layers=2,
        tp_size=1,
        tp_rank=0,
        layer_names=["a", "b"],
    )
    return msgspec.structs.replace(base, **changes)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "other"),
        ("dtype", "bfloat16"),
        ("block_size", 32),
        ("kv_layout", "2x16x4x4"),
        ("num_layers", 3),
        ("tp_size", 2),
    ],
)
def test_check_compatible_names_the_field(field: str, value: object) -> None:
    with pytest.raises(KVHandshakeError, match=f"{field} differs") as exc:
        check_compatible(_info(), _info(**{field: value}))
    assert str(exc.value).count("differs") == 1
    if field == "tp_size":
        assert "heterogeneous tensor parallelism" in str(exc.value)


def test_check_compatible_accepts_equal_layouts() -> None:
    check_compatible(_info(), _info(engine_id="other", tp_rank=0))


def test_config_reads_vllm_env_names_and_rejects_bad_values() -> None:
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": "6000", "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": "30"}
    cfg = ZmqConnectorConfig.from_extra_config({}, env)
    assert cfg.side_channel_port == 6000 and cfg.abort_request_timeout == 30.0
    assert (
        ZmqConnectorConfig.from_extra_config({"side_channel_port": 7000}, env).side_channel_port
        == 7000
    )
    with pytest.raises(ValueError, match="abort_request_timeout"):
        ZmqConnectorConfig.from_extra_config({"abort_request_timeout": 0}, {})
    with pytest.raises(ValueError, match="side_channel_port"):
        ZmqConnectorConfig.from_extra_config({"side_channel_port": "x"}, {})


def test_port_in_use_is_a_clear_error(engines: list[Engine]) -> None:
    port = free_port()
    engines.append(make_engine("kv_producer", port))
    with pytest.raises(ValueError, match="side_channel_port"):
        make_engine("kv_producer", port, use_ipc=False)


def test_siblings_with_the_same_remote_kv_pull_once(engines: list[Engine]) -> None:
    # n > 1: the frontend fans one request out; every child carries the same params.
    p = make_engine("kv_producer", free_port())
    d = make_engine("kv_consumer", free_port())
    engines += [p, d]
    params = prefill(p)
    d.sched.add_request(decode_request("d1-0", params))
    d.sched.add_request(decode_request("d1-1", params))
    run_until(
        [p, d],
        lambda: d.finished("d1-0") is not None and d.finished("d1-1") is not None,
    )
    assert d.stats["p2p.recv_transfers"] == 1
    assert d.stats.get("p2p.recv_failures", 0) == 0
    assert d.tokens("d1-0") == d.tokens("d1-1")
    n = len(PROMPT)
    # The second child hit the first's pulled blocks in the prefix cache.
    assert d.sim.computed_positions["d1-1"][0] == (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    run_until([p, d], lambda: p.usage == 0.0, timeout=3.0)


def test_decoder_dying_mid_transfer_leaves_nothing_held(engines: list[Engine]) -> None:
    # A decoder that handshakes, pulls, receives the blocks and dies before its DONE:
    # the prefill frees the blocks at abort_request_timeout; nothing leaks.
    import zmq

    from paged.connectors.kv.p2p import wire

    port = free_port()
    p = make_engine("kv_producer", port, abort_request_timeout=0.5)
    engines.append(p)
    params = prefill(p)
    assert params.remote_block_ids is not None
    info = p.worker_side._sender._info  # type: ignore[union-attr]  # the same layout
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([wire.HELLO, wire.ENCODER.encode(info)])
    assert sock.poll(3000)
    assert sock.recv_multipart()[0] == wire.HELLO
    pull = wire.PullRequest(1, "p1", list(params.remote_block_ids))
    sock.send_multipart([wire.PULL, wire.ENCODER.encode(pull)])
    p.step()  # the sender learns of the hold in the step after the response
    assert sock.poll(3000)
    frames = sock.recv_multipart()
    header = wire.DATA_DECODER.decode(frames[1])
    assert header.error is None and header.num_blocks == len(params.remote_block_ids)
    sock.close(linger=0)  # dies: no DONE
    ctx.term()
    assert p.usage > 0
    start = time.monotonic()
    run_until([p], lambda: p.usage == 0.0, timeout=3.0)
    assert time.monotonic() - start < 2.0
    assert p.worker_side.num_held_for_decoders() == 0
    p.sched.check_integrity()


def test_registered_in_the_factory() -> None:
    from paged.connectors.kv import KVConnectorFactory

    config = KVTransferConfig(kv_connector="PagedZmqConnector", kv_role="kv_consumer")
    factory = KVConnectorFactory.with_builtins()
    assert factory.get_connector_class(config) is PagedZmqConnector


def test_prefill_aborted_before_it_finishes_frees_at_once(engines: list[Engine]) -> None:
    # The client went away during the prefill: no params, nothing held.
    p = make_engine("kv_producer", free_port())
    engines.append(p)
    req = make_request("p1", PROMPT, max_tokens=1)
    p.sched.add_request(
        msgspec.structs.replace(req, kv_transfer_params=KVTransferParams(do_remote_decode=True))
    )
    p.sched.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    p.step()
    assert p.usage == 0.0 and p.worker_side.num_held_for_decoders() == 0
    # A prompt that ends on its one token (EOS) hands nothing over either, as vLLM.
    eos_req = make_request("p2", PROMPT, max_tokens=1, eos=(sum(PROMPT[-3:]) % 50) + 1)
    p.sched.add_request(
        msgspec.structs.replace(eos_req, kv_transfer_params=KVTransferParams(do_remote_decode=True))
    )
    run_until([p], lambda: p.finished("p2") is not None)
    out = p.finished("p2")
    assert out is not None and out.kv_transfer_params is None
    assert p.usage == 0.0
