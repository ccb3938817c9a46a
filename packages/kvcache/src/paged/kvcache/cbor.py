"""Canonical CBOR (RFC 8949) for the values block hashes are made of; stdlib only.

vLLM's `sha256_cbor` / `xxhash_cbor` hash `cbor2.dumps(obj, canonical=True)`.
This encoder writes the same bytes for what a block hash holds (None, bools,
ints of any size, floats, str, bytes, tuples/lists, dicts), so paged's hashes
equal vLLM's without making this package depend on cbor2 (the kvcache package
installs alone). The rules cbor2's canonical mode applies, and this follows:
- integers and lengths in the shortest head (0-23 inline, then 1/2/4/8 bytes);
  integers beyond 64 bits as bignums (tag 2 / tag 3, big-endian magnitude);
- floats in the shortest IEEE form that keeps the value (half, single, double);
  NaN and infinities as half floats;
- tuples and lists alike as arrays (CBOR has one sequence type);
- map keys sorted by their encoded bytes, shorter first (RFC 7049 canonical).
"""

from __future__ import annotations

import math
import struct

_MAJOR_UINT = 0
_MAJOR_NEGINT = 1
_MAJOR_BYTES = 2
_MAJOR_TEXT = 3
_MAJOR_ARRAY = 4
_MAJOR_MAP = 5
_MAJOR_TAG = 6
_U64_LIMIT = 1 << 64
_SMALL_UINTS = tuple(bytes((value,)) for value in range(24))


def _head(major: int, value: int) -> bytes:
    """The initial byte(s) of an item: major type plus a value in the shortest form."""
    m = major << 5
    if value < 24:
        return bytes((m | value,))
    if value < 0x100:
        return bytes((m | 24, value))
    if value < 0x10000:
        return bytes((m | 25,)) + value.to_bytes(2, "big")
    if value < 0x100000000:
        return bytes((m | 26,)) + value.to_bytes(4, "big")
    return bytes((m | 27,)) + value.to_bytes(8, "big")


def _encode_int(value: int, out: list[bytes]) -> None:
    if value >= 0:
        major, magnitude = _MAJOR_UINT, value
    else:
        major, magnitude = _MAJOR_NEGINT, -1 - value
    if magnitude < _U64_LIMIT:
        out.append(_head(major, magnitude))
        return
    # Bignum: tag 2 (positive) or 3 (negative) around the big-endian magnitude.
    raw = magnitude.to_bytes((magnitude.bit_length() + 7) // 8, "big")
    out.append(_head(_MAJOR_TAG, 2 + major))
    out.append(_head(_MAJOR_BYTES, len(raw)) + raw)


def _encode_float(value: float, out: list[bytes]) -> None:
    if math.isnan(value):
        out.append(b"\xf9\x7e\x00")
        return
    if math.isinf(value):
        out.append(b"\xf9\x7c\x00" if value > 0 else b"\xf9\xfc\x00")
        return
    for fmt, lead in ((">e", 0xF9), (">f", 0xFA)):
        try:
            packed = struct.pack(fmt, value)
        except OverflowError:
            continue
        if struct.unpack(fmt, packed)[0] == value:
            out.append(bytes((lead,)) + packed)
            return
    out.append(b"\xfb" + struct.pack(">d", value))


def _encode_into(obj: object, out: list[bytes]) -> None:
    t = type(obj)
    if t is int:
        assert isinstance(obj, int)
        _encode_int(obj, out)
    elif t is bytes:
        assert isinstance(obj, bytes)
        out.append(_head(_MAJOR_BYTES, len(obj)))
        out.append(obj)
    elif t is str:
        assert isinstance(obj, str)
        raw = obj.encode("utf-8")
        out.append(_head(_MAJOR_TEXT, len(raw)))
        out.append(raw)
    elif t is tuple or t is list:
        assert isinstance(obj, tuple | list)
        out.append(_head(_MAJOR_ARRAY, len(obj)))
        for item in obj:
            # Token ids: non-negative ints below 2**32, inlined (the hot path of
            # sha256_cbor; one call per token would triple the hashing time).
            if type(item) is int and 0 <= item < 0x100000000:
                if item < 24:
                    out.append(_SMALL_UINTS[item])
                elif item < 0x100:
                    out.append(bytes((0x18, item)))
                elif item < 0x10000:
                    out.append(b"\x19" + item.to_bytes(2, "big"))
                else:
                    out.append(b"\x1a" + item.to_bytes(4, "big"))
            else:
                _encode_into(item, out)
    elif obj is None:
        out.append(b"\xf6")
    elif t is bool:
        out.append(b"\xf5" if obj else b"\xf4")
    elif t is float:
        assert isinstance(obj, float)
        _encode_float(obj, out)
    elif t is dict:
        assert isinstance(obj, dict)
        items = sorted(
            ((dumps(key), dumps(value)) for key, value in obj.items()),
            key=lambda kv: (len(kv[0]), kv[0]),
        )
        out.append(_head(_MAJOR_MAP, len(items)))
        for key, value in items:
            out.append(key)
            out.append(value)
    else:
        raise TypeError(f"cannot CBOR-encode a value of type {t.__name__}: {obj!r}")


def dumps(obj: object) -> bytes:
    """`cbor2.dumps(obj, canonical=True)` for None, bool, int, float, str, bytes, lists, dicts."""
    out: list[bytes] = []
    _encode_into(obj, out)
    return b"".join(out)
