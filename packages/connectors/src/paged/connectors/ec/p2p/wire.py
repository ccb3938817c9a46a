"""What crosses between an encoder producer and a consumer (msgspec, msgpack over ZMQ).

Consumer (ZMQ DEALER, one per producer) <-> producer worker (ZMQ ROUTER), multipart:

    [FETCH, FetchRequest]   -> [DATA, EmbeddingHeader, raw bytes]   the producer holds it
                            -> [DATA, EmbeddingHeader(error=...)]   it does not (never
                                                                    encoded here, already
                                                                    acknowledged, expired)
    [ACK,   Ack]               (no reply: the producer frees the output now)

An output is one encoder item's embeddings, `[num_embeds, hidden]`, sent as the
row-major bytes of its dtype (`dtype` is torch's name without the prefix:
"float32", "bfloat16", ...). A producer answers at once, holding or not: the
proxy sends a request to the consumer only after the producer answered it, and
by then its outputs are held (they are saved in the step that encoded them).
"""

from __future__ import annotations

import msgspec
import torch

FETCH = b"FETCH"
DATA = b"DATA"
ACK = b"ACK"


class FetchRequest(msgspec.Struct, array_like=True, frozen=True):
    transfer_id: int
    mm_hash: str


class EmbeddingHeader(msgspec.Struct, array_like=True, frozen=True):
    transfer_id: int
    mm_hash: str
    shape: list[int] = msgspec.field(default_factory=list)
    dtype: str = ""
    error: str | None = None


class Ack(msgspec.Struct, array_like=True, frozen=True):
    mm_hash: str


FETCH_DECODER = msgspec.msgpack.Decoder(FetchRequest)
HEADER_DECODER = msgspec.msgpack.Decoder(EmbeddingHeader)
ACK_DECODER = msgspec.msgpack.Decoder(Ack)
ENCODER = msgspec.msgpack.Encoder()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """`dtype_name`'s inverse; `ValueError` for a name that is not a torch dtype."""
    dtype = getattr(torch, name, None) if name else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown embedding dtype {name!r}")
    return dtype


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without copying."""
    return memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy().data)


def tensor_from_bytes(header: EmbeddingHeader, data: memoryview | bytes) -> torch.Tensor:
    """The CPU tensor a DATA reply carries (a copy: the received buffer is read-only)."""
    dtype = parse_dtype(header.dtype)
    shape = tuple(header.shape)
    numel = 1
    for dim in shape:
        numel *= dim
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise ValueError(
            f"mm_hash {header.mm_hash}: {len(data)} bytes received for a {list(shape)} "
            f"{header.dtype} tensor ({expected} expected)"
        )
    if not expected:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)
