"""`MultiModalHasher`: content hashes of multimodal items (seed: MM処理パイプライン §3, mm_hash).

The hash (`mm_hash`) keys the processor cache, the encoder cache and the
prefix-cache extra keys, so it must name *what the model sees*, never where
the item came from: the same picture from a URL, a file or raw bytes hashes
equal, and two different pictures never do. It is taken over canonical bytes:

    image    -> b"image" | mode | width, height | pixel bytes  (palette images: as RGBA,
                so the palette and transparency, which change what the processor sees, count)
    ndarray  -> b"ndarray" | dtype | shape | bytes (C order)
    str/bytes/int/float/bool/None, lists, tuples, dicts (keys sorted) recursively

Every field is type-tagged and length-prefixed, so no two different inputs
share a byte stream (the encoding is injective). blake3 is used when the
`blake3` package is installed (vLLM's choice: fast, 256-bit); otherwise
stdlib `hashlib.sha256`, which FIPS builds of Python allow.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np
from PIL import Image


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def _blake3_factory() -> Callable[[], _Hasher] | None:
    try:
        from blake3 import blake3
    except ImportError:
        return None
    factory: Callable[[], _Hasher] = blake3
    return factory


def _sha256() -> _Hasher:
    return hashlib.sha256()


_BLAKE3 = _blake3_factory()


def _tag(name: bytes, payload_len: int) -> bytes:
    return struct.pack("<B", len(name)) + name + struct.pack("<Q", payload_len)


def _image_fields(image: Image.Image) -> tuple[str, Image.Image]:
    if image.mode in ("P", "PA"):
        image = image.convert("RGBA")
    return image.mode, image


def iter_item_bytes(obj: object) -> Iterator[bytes | memoryview]:
    """The canonical byte stream of `obj` (see the module docstring)."""
    if isinstance(obj, Image.Image):
        mode, image = _image_fields(obj)
        pixels = image.tobytes()
        header = mode.encode() + b"\0" + struct.pack("<QQ", *image.size)
        yield _tag(b"image", len(header) + len(pixels))
        yield header
        yield pixels
    elif isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("cannot hash numpy arrays of Python objects")
        arr = np.ascontiguousarray(obj)
        header = arr.dtype.str.encode() + b"\0" + struct.pack(f"<{arr.ndim}Q", *arr.shape)
        yield _tag(b"ndarray", len(header) + arr.nbytes)
        yield struct.pack("<Q", arr.ndim) + header
        yield arr.reshape(-1).view(np.uint8).tobytes() if arr.nbytes else b""
    elif isinstance(obj, bool | None):
        yield _tag(b"const", 1)
        yield b"t" if obj is True else b"f" if obj is False else b"n"
    elif isinstance(obj, int):
        text = str(obj).encode()
        yield _tag(b"int", len(text))
        yield text
    elif isinstance(obj, float):
        yield _tag(b"float", 8)
        yield struct.pack("<d", obj)
    elif isinstance(obj, str):
        data = obj.encode()
        yield _tag(b"str", len(data))
        yield data
    elif isinstance(obj, bytes | bytearray | memoryview):
        data = bytes(obj)
        yield _tag(b"bytes", len(data))
        yield data
    elif isinstance(obj, Mapping):
        yield _tag(b"dict", len(obj))
        for key in sorted(obj, key=str):
            yield from iter_item_bytes(str(key))
            yield from iter_item_bytes(obj[key])
    elif isinstance(obj, list | tuple):
        yield _tag(b"list", len(obj))
        for item in obj:
            yield from iter_item_bytes(item)
    else:
        raise TypeError(f"cannot hash multimodal input of type {type(obj).__name__}")


class MultiModalHasher:
    """Hex content hashes of multimodal items and their processing arguments."""

    @staticmethod
    def algorithm() -> str:
        """'blake3' or 'sha256': which one this process uses (both sides must agree)."""
        return "blake3" if _BLAKE3 is not None else "sha256"

    @staticmethod
    def hash_kwargs(*, use_fips: bool = False, **kwargs: Any) -> str:
        """Hash of the keyword arguments, names sorted: `hash_kwargs(model_id=..., image=img)`.

        `use_fips` forces sha256 even when blake3 is installed.
        """
        hasher: _Hasher = _sha256() if use_fips or _BLAKE3 is None else _BLAKE3()
        for chunk in iter_item_bytes(kwargs):
            hasher.update(chunk)
        return hasher.hexdigest()
