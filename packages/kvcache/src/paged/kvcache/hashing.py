"""Block hashing: hash chain, NONE_HASH seed, extra keys, request block hasher.

Block i's hash is `hash_fn((parent_hash, tokens_of_block_i, extra_keys))` with
`parent_hash` the hash of block i-1, or `NONE_HASH` for block 0. The chain makes
a block's hash depend on its whole prefix, so a left-to-right lookup that stops
at the first miss finds the longest cached prefix.

Hash functions take any value built from None, bool, int, float, str, bytes,
tuples and lists, and hash a canonical byte encoding of it (`encode_canonical`),
never `pickle` or Python's `hash()`: the result does not depend on
`PYTHONHASHSEED`, the platform or the Python version, so separate processes and
machines agree once they share the NONE_HASH seed (KV connectors rely on that).
The encoding is this package's own (type tag + big-endian length + payload),
not CBOR: hashes are stable across paged versions but do not equal vLLM's bytes.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any, overload

from paged.kvcache.ids import BlockHash
from paged.kvcache.protocols import HashableRequest

HashFn = Callable[[Any], bytes]

_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def _pack_int_sequence(seq: Sequence[Any]) -> bytes | None:
    """`I` + count + int64 big-endian items, or None if an item is not an int64."""
    n = len(seq)
    try:
        # One C call for the whole sequence (token ids take this path).
        return b"I" + _U32.pack(n) + struct.pack(f">{n}q", *seq)
    except (struct.error, TypeError):
        return None


def _encode_into(obj: object, out: list[bytes]) -> None:
    t = type(obj)
    if t is bytes:
        assert isinstance(obj, bytes)
        out.append(b"b" + _U32.pack(len(obj)))
        out.append(obj)
    elif t is tuple or t is list:
        assert isinstance(obj, tuple | list)
        n = len(obj)
        packed = _pack_int_sequence(obj) if n and type(obj[0]) is int else None
        if packed is not None:
            out.append(packed)
        else:
            out.append(b"l" + _U32.pack(n))
            for item in obj:
                _encode_into(item, out)
    elif obj is None:
        out.append(b"N")
    elif t is bool:
        out.append(b"T" if obj else b"F")
    elif t is int:
        assert isinstance(obj, int)
        if _I64_MIN <= obj <= _I64_MAX:
            out.append(b"i" + _I64.pack(obj))
        else:
            raw = obj.to_bytes((obj.bit_length() + 8) // 8, "big", signed=True)
            out.append(b"j" + _U32.pack(len(raw)) + raw)
    elif t is str:
        assert isinstance(obj, str)
        raw = obj.encode("utf-8")
        out.append(b"s" + _U32.pack(len(raw)))
        out.append(raw)
    elif t is float:
        assert isinstance(obj, float)
        out.append(b"f" + _F64.pack(obj))
    else:
        raise TypeError(f"cannot hash a value of type {t.__name__}: {obj!r}")


def encode_canonical(obj: object) -> bytes:
    """Deterministic, self-delimiting byte encoding of a nested value.

    Sequences whose items are all ints in the int64 range take a fast path
    (note: a bool inside such a sequence encodes like the int it equals).
    """
    out: list[bytes] = []
    _encode_into(obj, out)
    return b"".join(out)


def sha256(obj: object) -> bytes:
    """SHA-256 (32 bytes) of `encode_canonical(obj)`: the default hash."""
    return hashlib.sha256(encode_canonical(obj)).digest()


def xxhash(obj: object) -> bytes:
    """XXH3-128 (16 bytes) of `encode_canonical(obj)`; needs the `fast` extra.

    Not cryptographic: a crafted prompt could collide with another tenant's
    prefix. Use it only where that is acceptable.
    """
    try:
        import xxhash as _xxhash  # lazy: optional dependency
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the 'xxhash' hash function needs the optional dependency: "
            "pip install 'paged-kvcache[fast]'"
        ) from e
    digest: bytes = _xxhash.xxh3_128_digest(encode_canonical(obj))
    return digest


def _sha256_raw(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxhash_raw(data: bytes) -> bytes:
    import xxhash as _xxhash  # lazy: optional dependency

    digest: bytes = _xxhash.xxh3_128_digest(data)
    return digest


# Hash functions whose result is a digest of `encode_canonical(obj)`: the request
# block hasher encodes (parent, tokens, extra_keys) itself, without recursion,
# and hands the bytes to the raw digest. Other hash functions get the object.
_RAW_DIGESTS: dict[HashFn, Callable[[bytes], bytes]] = {}


_HASH_FNS: dict[str, HashFn] = {
    "sha256": sha256,
    "sha256_cbor": sha256,  # vLLM's name for its canonical default; same role here
    "xxhash": xxhash,
    "xxhash_cbor": xxhash,
}


_RAW_DIGESTS[sha256] = _sha256_raw
_RAW_DIGESTS[xxhash] = _xxhash_raw


def get_hash_fn_by_name(name: str) -> HashFn:
    """Look up a hash function: "sha256" (default) or "xxhash" (fast extra)."""
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise ValueError(
            f"unknown hash function name {name!r}; choose one of {sorted(_HASH_FNS)}"
        ) from None


# ---------------------------------------------------------------------- NONE_HASH
_none_hash: BlockHash = BlockHash(os.urandom(32))


def init_none_hash(hash_fn: HashFn = sha256, seed: int | str | bytes | None = None) -> BlockHash:
    """Set and return the seed of every hash chain in this process.

    With `seed` None, the seed comes from `PYTHONHASHSEED` when that is set and
    is random otherwise (hashes then differ between processes, which is safe but
    defeats cross-process prefix sharing). Give the same seed to every process
    and machine that must agree on hashes.
    """
    global _none_hash
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        _none_hash = BlockHash(os.urandom(32))
    else:
        _none_hash = BlockHash(hash_fn(("paged.kvcache.NONE_HASH", seed)))
    return _none_hash


def get_none_hash() -> BlockHash:
    """The current NONE_HASH (read it through this, not a copied constant)."""
    return _none_hash


def __getattr__(name: str) -> BlockHash:
    # `hashing.NONE_HASH` always reflects the latest `init_none_hash` call.
    if name == "NONE_HASH":
        return _none_hash
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------- chain
def hash_block_tokens(
    hash_function: HashFn,
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """Hash of one block given its parent's hash (None for block 0)."""
    if not parent_block_hash:
        parent_block_hash = _none_hash
    return BlockHash(hash_function((parent_block_hash, curr_block_token_ids, extra_keys)))


def need_extra_keys(request: HashableRequest) -> bool:
    """Whether any block of `request` has extra keys."""
    return (
        request.lora_name is not None or request.cache_salt is not None or bool(request.mm_features)
    )


# Source tags of the extra-key parts. Each part is a tuple whose first item names
# its source, so parts from different sources never compare equal: a salt "x"
# and a LoRA adapter named "x" give different keys (untagged strings would not).
LORA_KEY_TAG = "lora"
MM_KEY_TAG = "mm"
SALT_KEY_TAG = "salt"


def _first_mm_index(request: HashableRequest, start_token_idx: int) -> int:
    """Index of the first multimodal item whose span ends after `start_token_idx`."""
    feats = request.mm_features
    idx = 0
    while idx < len(feats):
        pos = feats[idx].mm_position
        if pos.offset + pos.length > start_token_idx:
            break
        idx += 1
    return idx


def _gen_mm_extra_hash_keys(
    request: HashableRequest, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[list[object], int]:
    """Keys of the items overlapping `[start, end)`; also the next item to look at.

    Items are assumed sorted by offset, so the scan resumes at `start_mm_idx`
    instead of restarting at item 0 for every block (a negative `start_mm_idx`
    counts from the end, as in vLLM). An item overlapping the block
    contributes `(identifier, offset - start_token_idx)` (vLLM's key): the
    relative offset distinguishes the same image placed at different positions
    inside otherwise identical blocks. Keys come tagged: `("mm", identifier,
    offset)`.
    """
    keys: list[object] = []
    feats = request.mm_features
    idx = start_mm_idx if start_mm_idx >= 0 else max(len(feats) + start_mm_idx, 0)
    while idx < len(feats):
        feat = feats[idx]
        offset = feat.mm_position.offset
        end = offset + feat.mm_position.length
        if offset >= end_token_idx:
            break  # this and later items start after the block
        if end > start_token_idx:
            keys.append((MM_KEY_TAG, feat.identifier, offset - start_token_idx))
        if end <= end_token_idx:
            idx += 1  # item finishes inside this block: later blocks skip it
        else:
            break  # item continues into the next block
    return keys, idx


def generate_block_hash_extra_keys(
    request: HashableRequest, start_token_idx: int, end_token_idx: int, start_mm_idx: int = 0
) -> tuple[tuple[object, ...] | None, int]:
    """Extra keys of the block `[start, end)` as hashed: LoRA, mm items, cache salt.

    Each part is tagged by its source, in vLLM's order: `("lora", name, path)`
    (every block), one `("mm", identifier, relative offset)` per overlapping mm
    item, `("salt", salt)` (block 0 only, and all later hashes through the
    chain). The LoRA part holds the adapter's path as well as its name, so a
    name re-pointed at new weights never reuses the old adapter's KV. Returns
    None (not an empty tuple) when there are none, and the next mm item index.
    `published_extra_keys` turns the result into vLLM's untagged event form.
    """
    keys: list[object] = []
    if request.lora_name is not None:
        keys.append((LORA_KEY_TAG, request.lora_name, request.lora_path))
    mm_keys, next_mm_idx = _gen_mm_extra_hash_keys(
        request, start_token_idx, end_token_idx, start_mm_idx
    )
    keys.extend(mm_keys)
    if start_token_idx == 0 and request.cache_salt:
        keys.append((SALT_KEY_TAG, request.cache_salt))
    return (tuple(keys) if keys else None), next_mm_idx


def published_extra_keys(extra_keys: tuple[object, ...] | None) -> tuple[object, ...] | None:
    """vLLM's untagged form of hashed extra keys, as `BlockStored.extra_keys` carries it.

    `("lora", name, path)` -> `name`; `("mm", identifier, offset)` ->
    `(identifier, offset)`; `("salt", salt)` -> `salt` (vLLM publishes the
    LoRA name, not the path). Consumers that index vLLM's events read the
    same shapes; the tags exist only inside the hash.
    """
    if extra_keys is None:
        return None
    out: list[object] = []
    for part in extra_keys:
        if not isinstance(part, tuple) or not part:
            raise ValueError(f"extra_keys holds an untagged part {part!r}")
        tag = part[0]
        if tag in (LORA_KEY_TAG, SALT_KEY_TAG):
            out.append(part[1])
        elif tag == MM_KEY_TAG:
            out.append(tuple(part[1:]))
        else:
            raise ValueError(f"extra_keys holds a part with unknown tag {tag!r}")
    return tuple(out)


RequestBlockHasher = Callable[[HashableRequest], list[BlockHash]]


def get_request_block_hasher(
    block_size: int, hash_fn: HashFn = sha256, none_hash: BlockHash | None = None
) -> RequestBlockHasher:
    """A function returning the hashes of a request's newly full blocks.

    It hashes blocks `len(request.block_hashes)` .. `num_tokens // block_size - 1`
    (only full blocks: a partial block is never cached) and returns them; the
    caller extends `request.block_hashes` with the result. Call it after the
    request is created and after each append of tokens. `none_hash` overrides
    the process-wide NONE_HASH for this hasher.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    raw_digest = _RAW_DIGESTS.get(hash_fn)
    # encode_canonical((parent, tokens, extra)) spelled out for the common case:
    # a 3-item list header, the parent as bytes, the tokens as one int64 array.
    triple_header = b"l" + _U32.pack(3) + b"b"
    tokens_header = b"I" + _U32.pack(block_size)
    pack_tokens = struct.Struct(f">{block_size}q").pack

    def hash_one(parent: bytes, block_tokens: Sequence[int], extra_keys: object) -> BlockHash:
        if raw_digest is not None:
            try:
                packed = pack_tokens(*block_tokens)
            except (struct.error, TypeError):
                pass  # a token outside int64: take the generic encoder
            else:
                tail = b"N" if extra_keys is None else encode_canonical(extra_keys)
                return BlockHash(
                    raw_digest(
                        triple_header
                        + _U32.pack(len(parent))
                        + parent
                        + tokens_header
                        + packed
                        + tail
                    )
                )
        return BlockHash(hash_fn((parent, block_tokens, extra_keys)))

    def request_block_hasher(request: HashableRequest) -> list[BlockHash]:
        prev_hashes = request.block_hashes
        start = len(prev_hashes) * block_size
        num_tokens = request.num_tokens
        if start + block_size > num_tokens:
            return []
        parent = prev_hashes[-1] if prev_hashes else (none_hash or _none_hash)
        tokens = request.all_token_ids
        extra = need_extra_keys(request)
        mm_idx = _first_mm_index(request, start) if extra else 0
        new_hashes: list[BlockHash] = []
        extra_keys: tuple[object, ...] | None = None
        while start + block_size <= num_tokens:
            end = start + block_size
            if extra:
                extra_keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            parent = hash_one(parent, tokens[start:end], extra_keys)
            new_hashes.append(parent)
            start = end
        return new_hashes

    # Request classes may read `block_size` to skip calls that cannot complete a
    # block (see SimpleRequest); a function attribute keeps the call itself direct.
    setattr(request_block_hasher, "block_size", block_size)  # noqa: B010
    return request_block_hasher


class BlockHashListWithBlockSize(Sequence[BlockHash]):
    """View of hashes at `hash_block_size` as hashes at a multiple `target_block_size`.

    Entry i concatenates the `target // hash` hashes covering the same tokens.
    Since each hash already chains its whole prefix, the concatenation is as
    unique as the last one; it is computed lazily on access.
    """

    __slots__ = ("block_hashes", "scale_factor")

    def __init__(
        self, block_hashes: Sequence[BlockHash], hash_block_size: int, target_block_size: int
    ) -> None:
        if hash_block_size <= 0 or target_block_size % hash_block_size != 0:
            raise ValueError(
                f"target_block_size ({target_block_size}) must be a positive multiple "
                f"of hash_block_size ({hash_block_size})"
            )
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def _get_value_at(self, idx: int) -> BlockHash:
        base = idx * self.scale_factor
        return BlockHash(b"".join(self.block_hashes[base : base + self.scale_factor]))

    @overload
    def __getitem__(self, idx: int) -> BlockHash: ...

    @overload
    def __getitem__(self, idx: slice) -> list[BlockHash]: ...

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        n = len(self)
        if isinstance(idx, slice):
            return [self._get_value_at(i) for i in range(*idx.indices(n))]
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"block hash index {idx} out of range for {n} blocks")
        return self._get_value_at(idx)
