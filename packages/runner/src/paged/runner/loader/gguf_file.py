"""A GGUF file's metadata and tensor table, read without decoding what is not asked for.

    read_gguf(path) -> GGUFFile   .fields[key].contents()   .tensors (name, tensor_type,
                                                              shape, data: a memmap view)

gguf-py's GGUFReader builds a numpy view for every part of every metadata value: a
49,152-token vocabulary (SmolLM2) took it ~5 s to open, Gemma 3's 262,144 tokens
~26 s, and paged opens a file up to three times at start-up (config, chat template,
weights; docs/cpu-startup.md). This walks the same layout (GGUF v2/v3, little-endian)
with struct over one mmap: scalars are decoded at once, arrays of strings are only
skipped (their offsets kept) until `contents()` asks for them. Big-endian files and
anything this reader does not know are handed to gguf-py's reader instead.

Layout: magic "GGUF", version u32, tensor count u64, metadata count u64; metadata
(key string, value type u32, value); tensor infos (name, n_dims u32, dims u64 each,
type u32, offset u64); tensor data from the next multiple of general.alignment (32).
A string is a u64 length and its UTF-8 bytes; an array an item type u32, a count u64
and the items.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import gguf
import numpy as np

_SCALARS: dict[int, tuple[str, type]] = {  # GGUFValueType -> (struct code, numpy type)
    0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16),
    4: ("I", np.uint32), 5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_),
    10: ("Q", np.uint64), 11: ("q", np.int64), 12: ("d", np.float64),
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_PLAIN = {  # tensor types whose data is an array of that numpy type (gguf-py's reader)
    "F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
    "I16": np.int16, "I32": np.int32, "I64": np.int64,
}  # fmt: skip


class Field(Protocol):
    """One metadata value (gguf-py's ReaderField has the same `contents`)."""

    def contents(self, index_or_slice: int | slice = ...) -> Any: ...


@dataclass(frozen=True)
class _Value:
    """A metadata value: a decoded scalar/string/numeric list, or a string array's offsets."""

    value: Any
    strings: np.ndarray | None  # offsets of each string's length field (string arrays)
    buffer: mmap.mmap | None

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        if self.strings is None:
            if isinstance(self.value, list):
                return self.value[index_or_slice]
            return self.value
        assert self.buffer is not None
        picked = self.strings[index_or_slice]
        if isinstance(index_or_slice, int):
            return _string_at(self.buffer, int(picked))[0]
        return [_string_at(self.buffer, int(at))[0] for at in picked]


@dataclass(frozen=True)
class Tensor:
    """One tensor's entry (the fields of gguf-py's ReaderTensor that paged reads)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray  # dims fastest-first, as the file lists them
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # a read-only view of the file


@dataclass(frozen=True)
class GGUFFile:
    """The metadata and tensors of one GGUF file (module docstring)."""

    fields: dict[str, Field]
    tensors: list[Any]  # Tensor, or gguf-py's ReaderTensor (the same fields)


def field_length(field: Field) -> int:
    """Items in an array value (1 for a scalar or a string)."""
    if isinstance(field, _Value):
        if field.strings is not None:
            return int(field.strings.shape[0])
        return len(field.value) if isinstance(field.value, list) else 1
    return len(getattr(field, "data", [None]))  # gguf-py's ReaderField: one index an item


def read_gguf(path: Path) -> GGUFFile:
    """Parse `path`; errors as gguf-py raises them (open_gguf turns them into a ValueError)."""
    with path.open("rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buffer[:4] != b"GGUF" or struct.unpack_from("<I", buffer, 4)[0] not in (2, 3):
        return _with_gguf_py(path)  # big-endian, another version, or not GGUF at all
    return _Parser(buffer, path).parse()


def _with_gguf_py(path: Path) -> GGUFFile:
    reader = gguf.GGUFReader(str(path))
    return GGUFFile(dict(reader.fields), list(reader.tensors))


def _string_at(buffer: mmap.mmap, at: int) -> tuple[str, int]:
    """The string whose length field is at `at`, and the offset after it."""
    (length,) = struct.unpack_from("<Q", buffer, at)
    end = at + 8 + length
    if end > len(buffer):
        raise ValueError(f"a string at byte {at} runs past the end of the file")
    return bytes(buffer[at + 8 : end]).decode("utf-8"), end


class _Parser:
    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer = buffer
        self.path = path
        self.at = 8

    def _unpack(self, code: str) -> Any:
        value = struct.unpack_from("<" + code, self.buffer, self.at)[0]
        self.at += struct.calcsize(code)
        return value

    def _string(self) -> str:
        text, self.at = _string_at(self.buffer, self.at)
        return text

    def parse(self) -> GGUFFile:
        n_tensors, n_fields = self._unpack("Q"), self._unpack("Q")
        version = struct.unpack_from("<I", self.buffer, 4)[0]
        fields: dict[str, Field] = {  # gguf-py's reader lists these first too
            "GGUF.version": _Value(version, None, None),
            "GGUF.tensor_count": _Value(n_tensors, None, None),
            "GGUF.kv_count": _Value(n_fields, None, None),
        }
        for _ in range(n_fields):
            key = self._string()
            fields[key] = self._value(self._unpack("I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = fields["general.alignment"].contents() if "general.alignment" in fields else 32
        start = -(-self.at // int(alignment)) * int(alignment)
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        names: set[str] = set()
        tensors: list[Any] = []
        for name, dims, ggml_type, offset in infos:
            if name in names:
                raise ValueError(f"Found duplicated tensor with name {name}")
            names.add(name)
            tensors.append(_tensor(data, name, dims, ggml_type, start + offset))
        return GGUFFile(fields, tensors)

    def _value(self, kind: int) -> _Value:
        if kind in _SCALARS:
            return _Value(self._unpack(_SCALARS[kind][0]), None, None)
        if kind == _STRING:
            return _Value(self._string(), None, None)
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self._unpack("I"), self._unpack("Q")
        if item == _STRING:
            offsets = np.empty(count, dtype=np.int64)
            for i in range(count):  # only the lengths: decoded when asked for
                offsets[i] = self.at
                self.at += 8 + struct.unpack_from("<Q", self.buffer, self.at)[0]
            if self.at > len(self.buffer):
                raise ValueError("a string array runs past the end of the file")
            return _Value(None, offsets, self.buffer)
        if item not in _SCALARS:
            raise ValueError(f"GGUF arrays of value type {item} are not read here")
        code, np_type = _SCALARS[item]
        size = struct.calcsize(code)
        raw = np.frombuffer(self.buffer, dtype=np.dtype(np_type).newbyteorder("<"),
                            count=count, offset=self.at)  # fmt: skip
        self.at += size * count
        return _Value(raw.tolist(), None, None)

    def _tensor_info(self) -> tuple[str, np.ndarray, gguf.GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._unpack("I")
        dims = np.array([self._unpack("Q") for _ in range(n_dims)], dtype=np.uint64)
        ggml_type = gguf.GGMLQuantizationType(self._unpack("I"))
        return name, dims, ggml_type, self._unpack("Q")


def _tensor(
    data: np.ndarray, name: str, dims: np.ndarray, ggml_type: gguf.GGMLQuantizationType, at: int
) -> Tensor:
    """The tensor's view of the file, shaped as gguf-py's reader shapes it."""
    n_elements = int(np.prod(dims))
    block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    n_bytes = n_elements * type_size // block
    if at + n_bytes > data.shape[0]:
        raise ValueError(f"tensor {name!r} runs past the end of the file (truncated)")
    shape = tuple(int(d) for d in reversed(dims.tolist()))
    plain = _PLAIN.get(ggml_type.name)
    raw = data[at : at + n_bytes]
    if plain is not None:
        view = raw.view(plain).reshape(shape)
    else:
        view = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, ggml_type))
    return Tensor(name, ggml_type, dims, n_elements, n_bytes, at, view)
