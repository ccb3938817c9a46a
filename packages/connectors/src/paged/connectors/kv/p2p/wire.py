"""What crosses between the roles and between engines (msgspec, msgpack).

Scheduler -> worker (one `ZmqStepMetadata` per step, bytes in SchedulerOutput):
    sends     requests this prefill finished and holds for a decoder
    recvs     requests this decoder must pull (local blocks <- remote blocks)
    releases  pulls that will never happen (aborted before admission): tell
              the prefill to free its blocks now instead of at the timeout
    idle      nothing was scheduled this step (the worker may wait a little
              for transfer news instead of letting the engine spin)
    finished  requests finished since the last step (use_layerwise: their
              staged pulls must not be copied, their blocks may be reused)

Decoder (ZMQ DEALER) <-> prefill worker (ZMQ ROUTER), multipart messages:
    [HELLO, KVLayoutInfo]            -> [HELLO, HelloReply]
    [PULL,  PullRequest]             -> [DATA,  DataHeader, layer 0 bytes, layer 1 bytes, ...]
    [DONE,  Done]                       (no reply: the prefill may free the blocks)

A layer's bytes are `cache[:, block_ids]` of the prefill, `[2, n, B, H, D]`
contiguous in the handshake's dtype; `n = DataHeader.num_blocks` may be less
than asked (blocks the prefill does not hold): the decoder keeps that prefix
and reports the rest as load errors.

Hybrid models (several KV cache groups): `block_ids` lists are the groups'
lists one after the other, `group_sizes` their lengths (empty: one group); a
layer's bytes are its own group's blocks. A pull is then all or nothing
(`num_blocks` is the whole count or 0).
"""

from __future__ import annotations

import msgspec

from paged.connectors.kv.p2p.handshake import KVLayoutInfo

HELLO = b"HELLO"
PULL = b"PULL"
DATA = b"DATA"
DONE = b"DONE"


class SendSpec(msgspec.Struct, array_like=True, frozen=True):
    req_id: str
    block_ids: list[int]


class RemoteAddress(msgspec.Struct, array_like=True, frozen=True):
    engine_id: str
    host: str
    port: int


class RecvSpec(msgspec.Struct, array_like=True, frozen=True):
    req_id: str
    remote: RemoteAddress
    remote_request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]  # same length as local_block_ids
    group_sizes: list[int] = msgspec.field(default_factory=list)  # hybrid: ids per group


class ReleaseSpec(msgspec.Struct, array_like=True, frozen=True):
    remote: RemoteAddress
    remote_request_id: str


class ZmqStepMetadata(msgspec.Struct, array_like=True, frozen=True):
    sends: list[SendSpec] = msgspec.field(default_factory=list)
    recvs: list[RecvSpec] = msgspec.field(default_factory=list)
    releases: list[ReleaseSpec] = msgspec.field(default_factory=list)
    idle: bool = False
    finished: list[str] = msgspec.field(default_factory=list)


class HelloReply(msgspec.Struct, array_like=True, frozen=True):
    info: KVLayoutInfo
    error: str | None = None  # the prefill's own check failed (it names the field)


class PullRequest(msgspec.Struct, array_like=True, frozen=True):
    transfer_id: int
    remote_request_id: str
    block_ids: list[int]
    group_sizes: list[int] = msgspec.field(default_factory=list)  # hybrid: ids per group


class DataHeader(msgspec.Struct, array_like=True, frozen=True):
    transfer_id: int
    num_blocks: int
    error: str | None = None


class Done(msgspec.Struct, array_like=True, frozen=True):
    remote_request_id: str


def split_groups(block_ids: list[int], group_sizes: list[int]) -> list[list[int]]:
    """The per-group lists of a concatenated `block_ids`; `ValueError` if the sizes disagree."""
    if sum(group_sizes) != len(block_ids) or any(n < 0 for n in group_sizes):
        raise ValueError(f"group sizes {group_sizes} do not split {len(block_ids)} block ids")
    out: list[list[int]] = []
    start = 0
    for n in group_sizes:
        out.append(block_ids[start : start + n])
        start += n
    return out


HELLO_REPLY_DECODER = msgspec.msgpack.Decoder(HelloReply)
INFO_DECODER = msgspec.msgpack.Decoder(KVLayoutInfo)
PULL_DECODER = msgspec.msgpack.Decoder(PullRequest)
DATA_DECODER = msgspec.msgpack.Decoder(DataHeader)
DONE_DECODER = msgspec.msgpack.Decoder(Done)
ENCODER = msgspec.msgpack.Encoder()
