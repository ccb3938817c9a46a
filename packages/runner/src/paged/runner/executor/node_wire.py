"""The node link's messages: node 0's executor <-> each headless node's agent (ZMQ over TCP).

    node 0 (ROUTER, binds master_addr:master_port+1)        node R > 0 (DEALER, connects)
        <------------------------------- Hello(node_rank, fingerprint)
        Welcome(output_rank | error) ------------------------>
        <------------------------------- NodeReady(errors)      (its workers loaded)
        [CALL, flags, WorkerCall bytes] ----------------------->   (every call, in order)
        <------------------------------- NodeReply(replies)     (one per call, in order)
        Heartbeat <--------------------------------------------> Heartbeat (both ways, each
                                                                 interval)
        <------------------------------- NodeFailed(reason)     (its worker died)

Every message is two ZMQ frames: a one-byte kind and its body. Calls travel as
the multiproc executor's own msgpack `WorkerCall` bytes, untouched: the agent
copies them into its node's shared-memory ring without decoding them. Control
messages are msgspec Structs in one tagged union.

A DEALER queues what it sends until the connection is up, and a ROUTER only
sends to peers that said Hello, so no message is lost to a slow joiner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec

from paged.runner.config import EngineConfig
from paged.runner.executor.messages import Reply

KIND_CONTROL = b"M"
KIND_CALL = b"C"
# Flags frame of a call: whether only the output rank's result (and any error) comes back.
FLAG_ALL_RESULTS = b"\x00"
FLAG_OUTPUT_RANK_ONLY = b"\x01"


class Fingerprint(msgspec.Struct, array_like=True, frozen=True):
    """The settings every node must share; node 0 refuses a node whose settings differ."""

    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    nnodes: int
    architecture: str
    num_hidden_layers: int
    vocab_size: int
    dtype: str
    device_type: str
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    seed: int
    kv_cache_dtype: str = "auto"  # nodes must store the same cache format

    @classmethod
    def of(cls, config: EngineConfig) -> Fingerprint:
        mc, parallel, limits = config.model_config, config.parallel_config, config.scheduler_limits
        return cls(
            world_size=parallel.world_size,
            tensor_parallel_size=parallel.tensor_parallel_size,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
            nnodes=parallel.nnodes,
            architecture=mc.architecture,
            num_hidden_layers=mc.num_hidden_layers,
            vocab_size=mc.vocab_size,
            dtype=mc.dtype_name,
            device_type=mc.device.split(":")[0],
            max_model_len=mc.max_model_len,
            block_size=config.cache_config.block_size,
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            seed=config.seed,
            kv_cache_dtype=config.cache_config.cache_dtype,
        )

    def differences(self, other: Fingerprint) -> list[str]:
        """'field: mine vs theirs' for every field that differs."""
        return [
            f"{name}: {getattr(self, name)!r} here vs {getattr(other, name)!r} there"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]


class Hello(msgspec.Struct, tag=True, array_like=True, frozen=True):
    node_rank: int
    pid: int
    host: str
    fingerprint: Fingerprint


class Welcome(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Node 0's answer to Hello: go ahead (start the workers), or why not."""

    output_rank: int
    error: str | None = None


class NodeReady(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The node's workers joined torch.distributed and loaded the model (or why not)."""

    node_rank: int
    errors: list[str] = []


class NodeReply(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """One node's answer to one call: its ranks' replies (trimmed as the call's flag asks)."""

    node_rank: int
    replies: list[Reply]


class NodeFailed(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The node cannot continue (a worker died); it exits after sending this."""

    node_rank: int
    reason: str


class Heartbeat(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


ControlMessage = Hello | Welcome | NodeReady | NodeReply | NodeFailed | Heartbeat

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ControlMessage)


def control_frames(message: ControlMessage) -> list[bytes]:
    return [KIND_CONTROL, _ENCODER.encode(message)]


def decode_control(body: bytes) -> ControlMessage:
    message: ControlMessage = _DECODER.decode(body)
    return message


@dataclass(frozen=True)
class LinkTimeouts:
    """How long the node link waits; each can be set from the environment.

    join_s (PAGED_NODE_JOIN_TIMEOUT_S): node 0 waits this long for every node
    to say Hello and load its workers; a headless node waits this long for
    node 0 to answer its Hello.
    heartbeat_interval_s: each side sends a Heartbeat this often when idle.
    heartbeat_timeout_s (PAGED_NODE_HEARTBEAT_TIMEOUT_S): a peer silent this
    long is declared dead (a lost host or network; a dead process is noticed
    sooner, when its TCP connection closes).
    """

    join_s: float = 600.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("join_s", "heartbeat_interval_s", "heartbeat_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )

    @classmethod
    def from_env(cls) -> LinkTimeouts:
        return cls(
            join_s=_env_seconds("PAGED_NODE_JOIN_TIMEOUT_S", cls.join_s),
            heartbeat_timeout_s=_env_seconds(
                "PAGED_NODE_HEARTBEAT_TIMEOUT_S", cls.heartbeat_timeout_s
            ),
        )


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}: must be a number of seconds, got {raw!r}") from None


def link_endpoint(master_addr: str, master_port: int) -> str:
    """The node link's TCP endpoint: node 0's master_addr, one port above master_port."""
    import socket

    try:
        ip = socket.gethostbyname(master_addr)
    except OSError as exc:
        raise ValueError(f"master_addr: cannot resolve {master_addr!r}: {exc}") from None
    return f"tcp://{ip}:{master_port + 1}"


def free_port_pair(host: str = "127.0.0.1", attempts: int = 100) -> int:
    """A free port P on `host` with P+1 free as well: a master port for one machine's tests.

    torch.distributed meets at P and node 0's link listens at P+1 (`link_endpoint`),
    so both must be free. Either may be taken again before it is bound: callers
    that start servers on it retry or accept the race, as with any free port.
    """
    import socket

    for _ in range(attempts):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind((host, port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no two consecutive free ports on {host} after {attempts} attempts")
