"""Block hashing: hash chain, NONE_HASH seed, extra keys, request block hasher.

Block i's hash is `hash_fn((parent_hash, tokens_of_block_i, extra_keys))` with
`parent_hash` the hash of block i-1, or `NONE_HASH` for block 0. The chain makes
a block's hash depend on its whole prefix, so a left-to-right lookup that stops
at the first miss finds the longest cached prefix.

The hash functions are vLLM 0.33's (vllm/utils/hashing.py, selected by
`--prefix-caching-hash-algo`): `sha256` (default) and `xxhash` digest
`pickle.dumps(obj, protocol=5)`; `sha256_cbor` and `xxhash_cbor` digest
canonical CBOR (`paged.kvcache.cbor`, byte-identical to cbor2's canonical
mode). With the same NONE_HASH seed (vLLM's rule: PYTHONHASHSEED, else
"vllm-none-hash" for the SHA-256 ones) paged's block hashes are vLLM's, bit for
bit, so routers that compute vLLM's hashes from prompts match paged's KV
events. `paged_sha256` / `paged_xxhash` are paged-only: the same digests over
paged's own type-tagged encoding (`encode_canonical`), which never involves
pickle; they do not equal vLLM's bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any, overload

from paged.kvcache import cbor
from paged.kvcache.ids import BlockHash
from paged.kvcache.protocols import HashableRequest

logger = logging.getLogger(__name__)

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
    """vLLM 0.33's default: SHA-256 (32 bytes) of `pickle.dumps(obj, protocol=5)`.

    Equal to vLLM's `sha256` (vllm/utils/hashing.py) for the same value: the
    pickle of tuples, ints, str, bytes and None is the same bytes on every
    CPython 3.8+. Token ids must be a tuple (a list pickles differently);
    `hash_block_tokens` and the request hasher make it one, as vLLM does.
    """
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: object) -> bytes:
    """vLLM's `sha256_cbor`: SHA-256 of canonical CBOR (language-independent)."""
    return hashlib.sha256(cbor.dumps(obj)).digest()


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash as _xxhash  # lazy: optional dependency
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the xxhash block-hash functions need the optional dependency: "
            "pip install 'paged-kvcache[fast]'"
        ) from e
    digest: bytes = _xxhash.xxh3_128_digest(data)
    return digest


def xxhash(obj: object) -> bytes:
    """vLLM's `xxhash`: XXH3-128 (16 bytes) of the pickle; needs the `fast` extra.

    Not cryptographic: a crafted prompt could collide with another tenant's
    prefix, which is why its NONE_HASH seed is random unless PYTHONHASHSEED is set.
    """
    return _xxh3_128(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj: object) -> bytes:
    """vLLM's `xxhash_cbor`: XXH3-128 of canonical CBOR; needs the `fast` extra."""
    return _xxh3_128(cbor.dumps(obj))


def paged_sha256(obj: object) -> bytes:
    """paged-only: SHA-256 of `encode_canonical(obj)` (not vLLM's bytes; see module doc)."""
    return hashlib.sha256(encode_canonical(obj)).digest()


def paged_xxhash(obj: object) -> bytes:
    """paged-only: XXH3-128 of `encode_canonical(obj)`; needs the `fast` extra."""
    return _xxh3_128(encode_canonical(obj))


def _sha256_raw(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# How each hash function serialises before its digest, so the request block
# hasher can build the bytes of (parent, tokens, extra_keys) itself: "pickle",
# "cbor" or "paged" (encode_canonical). Other (user) hash functions get the object.
_SERIALIZERS: dict[HashFn, tuple[str, Callable[[bytes], bytes]]] = {
    sha256: ("pickle", _sha256_raw),
    xxhash: ("pickle", _xxh3_128),
    sha256_cbor: ("cbor", _sha256_raw),
    xxhash_cbor: ("cbor", _xxh3_128),
    paged_sha256: ("paged", _sha256_raw),
    paged_xxhash: ("paged", _xxh3_128),
}

_HASH_FNS: dict[str, HashFn] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
    "paged_sha256": paged_sha256,
    "paged_xxhash": paged_xxhash,
}

# vLLM's --prefix-caching-hash-algo choices (vllm/config/cache.py PrefixCachingHashAlgo).
VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
HASH_ALGOS = tuple(_HASH_FNS)

# Not collision resistant: a predictable NONE_HASH seed would let a tenant build
# colliding blocks offline, so these get a random seed unless PYTHONHASHSEED is set.
_NON_CRYPTO_HASH_FNS = frozenset({xxhash, xxhash_cbor, paged_xxhash})

# vLLM 0.33's fixed seed for cryptographic algorithms (kv_cache_utils.py
# DEFAULT_NONE_HASH_SEED): independent processes agree without configuration.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def get_hash_fn_by_name(name: str) -> HashFn:
    """Look up a hash function by vLLM's algorithm name (or a paged-only one)."""
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise ValueError(
            f"unknown hash function name {name!r}; choose one of {list(_HASH_FNS)}"
        ) from None


# ---------------------------------------------------------------------- NONE_HASH
_none_hash: BlockHash = BlockHash(sha256(DEFAULT_NONE_HASH_SEED))
_none_hash_seed: str = DEFAULT_NONE_HASH_SEED


def resolve_none_hash_seed(hash_fn: HashFn, seed: int | str | None = None) -> str:
    """The seed NONE_HASH derives from, by vLLM 0.33's rule plus paged's explicit seed.

    An explicit `seed` (paged's `--block-hash-seed`) wins, as its decimal string;
    then `PYTHONHASHSEED`; then vLLM's fixed "vllm-none-hash" for cryptographic
    algorithms and 32 random bytes (hex) for xxhash ones
    (vllm/v1/core/kv_cache_utils.py resolve_none_hash_seed).
    """
    if seed is not None:
        return str(seed)
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    if hash_fn in _NON_CRYPTO_HASH_FNS:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def init_none_hash(hash_fn: HashFn = sha256, seed: int | str | None = None) -> BlockHash:
    """Set and return the seed hash of every chain in this process: `hash_fn(seed string)`.

    With sha256 and no seed, this is vLLM 0.33's NONE_HASH bit for bit, so a
    router computing vLLM's hashes matches paged's. With xxhash and neither
    `seed` nor PYTHONHASHSEED, the seed is random per process (a warning says
    so: hashes then differ between processes, as in vLLM).
    """
    global _none_hash, _none_hash_seed
    _none_hash_seed = resolve_none_hash_seed(hash_fn, seed)
    if hash_fn in _NON_CRYPTO_HASH_FNS and seed is None and "PYTHONHASHSEED" not in os.environ:
        logger.warning(
            "Using a random per-process NONE_HASH seed because %s is not collision "
            "resistant; block hashes are not reproducible across processes. Set "
            "PYTHONHASHSEED (or --block-hash-seed) to share prefix caches, or use sha256.",
            getattr(hash_fn, "__name__", hash_fn),
        )
    _none_hash = BlockHash(hash_fn(_none_hash_seed))
    return _none_hash


def get_none_hash() -> BlockHash:
    """The current NONE_HASH (read it through this, not a copied constant)."""
    return _none_hash


def get_none_hash_seed() -> str:
    """The seed the current NONE_HASH was derived from (peers compare it)."""
    return _none_hash_seed


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
    # A tuple as vLLM passes it: the pickle-based functions hash a list differently.
    tokens = tuple(curr_block_token_ids)
    return BlockHash(hash_function((parent_block_hash, tokens, extra_keys)))


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
SALT_KEY_TAG = "cache_salt"  # vLLM 0.33: ("cache_salt", salt)


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
    item, `("cache_salt", salt)` (block 0 only, and all later hashes through the
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
    `(identifier, offset)`; `("cache_salt", salt)` -> `salt` (vLLM publishes the
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
    serializer, raw_digest = _SERIALIZERS.get(hash_fn, ("object", _sha256_raw))
    # encode_canonical((parent, tokens, extra)) spelled out for the common case:
    # a 3-item list header, the parent as bytes, the tokens as one int64 array.
    triple_header = b"l" + _U32.pack(3) + b"b"
    tokens_header = b"I" + _U32.pack(block_size)
    pack_tokens = struct.Struct(f">{block_size}q").pack
    dumps = pickle.dumps
    protocol = pickle.HIGHEST_PROTOCOL

    def hash_one(parent: bytes, block_tokens: Sequence[int], extra_keys: object) -> BlockHash:
        if serializer == "pickle":
            # vLLM's bytes: pickle of (parent, tuple(tokens), extra_keys).
            return BlockHash(raw_digest(dumps((parent, tuple(block_tokens), extra_keys), protocol)))
        if serializer == "cbor":
            return BlockHash(raw_digest(cbor.dumps((parent, block_tokens, extra_keys))))
        if serializer == "paged":
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
        return BlockHash(hash_fn((parent, tuple(block_tokens), extra_keys)))

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

    Entry i is the last of the `target // hash` hashes covering the same tokens:
    it already chains the whole prefix up to the target block's end, so it is
    that block's hash (vLLM 0.33's rule, kv_cache_utils.py
    BlockHashListWithBlockSize._get_value_at; the same bytes in KV events).
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
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]

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
