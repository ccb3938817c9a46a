"""Chunks: the unit the offloading tiers store (seed: LMCache チャンク, クロスレイヤー レイアウト).

A chunk is `blocks_per_chunk` consecutive KV blocks of one request, keyed by
the block hash of its last block. That hash chains over every earlier token
and the extra keys (cache salt, LoRA, multimodal identifiers), so equal keys
mean equal KV for the same model:

    block hashes   h0 h1 h2 h3 | h4 h5 h6 h7 | h8 ..      (blocks_per_chunk = 4)
    chunk keys              h3 |          h7 | (partial: never stored)

Hybrid models store one chunk per KV cache group, holding that group's
layers only; every group hashes the same chain, so group g's key is the
chunk key with `_g{g}` appended (group 0 keeps the plain key, so
single-group stores are unchanged; vLLM 0.33 appends the group index to the
hash too: v1/kv_offload/base.py:30-32).

Payload: the chunk's blocks across all layers in one contiguous buffer,
block-major (the cross-layer layout), so the first k blocks of a chunk are a
contiguous prefix of it:

    [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_size]

Encoded form (one file per chunk on disk; the same bytes in host memory):

    magic "PGKVCHNK" | u32 version | u32 fingerprint length | fingerprint (JSON)
    | u64 payload length | 32-byte blake2b(payload) | payload

A chunk whose magic, version, fingerprint, length or checksum disagrees is a
`ChunkError`: the caller counts it as a miss and reports a load error, so the
scheduler recomputes (never a wrong token).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NewType

# A chunk key: the hex of the chunk's last block hash (safe as a file name).
ChunkKey = NewType("ChunkKey", str)

MAGIC = b"PGKVCHNK"
FORMAT_VERSION = 1
_DIGEST_SIZE = 32
_PREFIX = struct.Struct("<8sII")  # magic, version, fingerprint length
_PAYLOAD = struct.Struct("<Q")


class ChunkError(ValueError):
    """A stored chunk that must not be used (corrupt, truncated, foreign or missing)."""


@dataclass(frozen=True)
class Fingerprint:
    """What must match for stored KV to be valid in this engine (one rank's slice).

    dtype is the torch dtype's name (e.g. "bfloat16"); layer_names are in the
    order of the payload's layer axis.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    layer_names: tuple[str, ...]
    rank: int = 0
    world_size: int = 1
    # The model's name; set for the Redis tier, shared by engines of several models
    # (left out of the encoding when empty, so disk chunks keep their bytes).
    model: str = ""

    def encode(self) -> bytes:
        data = asdict(self)
        data["layer_names"] = list(self.layer_names)
        if not self.model:
            del data["model"]
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers (K and V) for this rank."""
        itemsize = _DTYPE_BYTES.get(self.dtype)
        if itemsize is None:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_size * itemsize
        return per_layer * self.num_layers


_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}


def chunk_keys(block_hashes: Sequence[bytes], blocks_per_chunk: int) -> list[ChunkKey]:
    """Keys of the full chunks covered by these block hashes, in order."""
    n = len(block_hashes) // blocks_per_chunk
    return [ChunkKey(block_hashes[(i + 1) * blocks_per_chunk - 1].hex()) for i in range(n)]


_GROUP_SEP = "_g"


def group_chunk_key(key: ChunkKey, group: int) -> ChunkKey:
    """The key of KV cache group `group`'s chunk for the chunk keyed `key`."""
    return key if group == 0 else ChunkKey(f"{key}{_GROUP_SEP}{group}")


def split_group_key(key: ChunkKey) -> tuple[bytes, int]:
    """(the chunk's last block hash, its KV cache group) of a group chunk key."""
    hex_hash, sep, group = key.partition(_GROUP_SEP)
    return bytes.fromhex(hex_hash), int(group) if sep else 0


def header_size(fingerprint: Fingerprint) -> int:
    return _PREFIX.size + len(fingerprint.encode()) + _PAYLOAD.size + _DIGEST_SIZE


def encode_chunk(fingerprint: Fingerprint, payload: bytes | memoryview) -> bytes:
    """Header + payload; the checksum covers the payload."""
    fp = fingerprint.encode()
    digest = hashlib.blake2b(payload, digest_size=_DIGEST_SIZE).digest()
    return b"".join(
        (
            _PREFIX.pack(MAGIC, FORMAT_VERSION, len(fp)),
            fp,
            _PAYLOAD.pack(len(payload)),
            digest,
            bytes(payload),
        )
    )


def decode_chunk(data: bytes | memoryview, fingerprint: Fingerprint) -> memoryview:
    """The payload of an encoded chunk; `ChunkError` naming what is wrong."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise ChunkError(f"truncated chunk: {len(view)} bytes, no header")
    magic, version, fp_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise ChunkError("not a paged KV chunk (bad magic)")
    if version != FORMAT_VERSION:
        raise ChunkError(f"chunk format version {version}, this engine reads {FORMAT_VERSION}")
    pos = _PREFIX.size
    stored_fp = bytes(view[pos : pos + fp_len])
    pos += fp_len
    if stored_fp != fingerprint.encode():
        raise ChunkError(f"foreign chunk: fingerprint {stored_fp!r} is not this engine's")
    if len(view) < pos + _PAYLOAD.size + _DIGEST_SIZE:
        raise ChunkError("truncated chunk header")
    (length,) = _PAYLOAD.unpack_from(view, pos)
    pos += _PAYLOAD.size
    digest = bytes(view[pos : pos + _DIGEST_SIZE])
    pos += _DIGEST_SIZE
    payload = view[pos:]
    if len(payload) != length:
        raise ChunkError(f"truncated chunk: payload {len(payload)} bytes, header says {length}")
    if hashlib.blake2b(payload, digest_size=_DIGEST_SIZE).digest() != digest:
        raise ChunkError("chunk checksum mismatch (corrupt payload)")
    return payload
