"""msgpack (de)serialization of engine messages, with out-of-band large buffers.

Messages are msgspec Structs encoded as msgpack. numpy arrays, which msgpack
cannot carry, are encoded through an extension type: small ones inline, those
of at least `ZERO_COPY_THRESHOLD` bytes as their own ZMQ frame that is sent
without copying (``send_multipart(copy=False)``) and decoded with
``np.frombuffer`` straight over the received frame (no copy either way).

`bytes` fields of the boundary structs (e.g. `TensorData.data`) are encoded
inline by msgspec: one copy into the payload on each side.

Encoders and decoders keep per-message state while they run: use one per
thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

# Below this an extra frame costs more than copying into the payload.
ZERO_COPY_THRESHOLD = 256

_EXT_NDARRAY = 1

T = TypeVar("T")

# What `zmq.Socket.send_multipart` accepts and `recv_multipart` yields as buffers.
Frame = bytes | memoryview


class MsgpackEncoder:
    """Encodes one object into ``[payload, *out_of_band_buffers]``."""

    def __init__(self, zero_copy_threshold: int = ZERO_COPY_THRESHOLD) -> None:
        if zero_copy_threshold < 0:
            raise ValueError(f"zero_copy_threshold must be >= 0, got {zero_copy_threshold}")
        self._threshold = zero_copy_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: list[Frame] | None = None

    def encode(self, obj: object) -> list[Frame]:
        aux: list[Frame] = []
        self._aux = aux
        try:
            payload = self._encoder.encode(obj)
        finally:
            self._aux = None
        return [payload, *aux]

    def _enc_hook(self, obj: object) -> object:
        if isinstance(obj, np.ndarray):
            return self._encode_ndarray(obj)
        if isinstance(obj, np.generic):
            return obj.item()  # numpy scalars travel as plain msgpack numbers
        raise TypeError(f"cannot serialize objects of type {type(obj).__name__}")

    def _encode_ndarray(self, arr: np.ndarray[Any, Any]) -> msgspec.msgpack.Ext:
        if arr.dtype.hasobject:
            raise TypeError("cannot serialize numpy arrays of Python objects")
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
        data: int | bytes
        if arr.nbytes >= self._threshold and self._aux is not None:
            # The frame index (1-based: frame 0 is the payload) replaces the bytes.
            self._aux.append(arr.reshape(-1).view(np.uint8).data)
            data = len(self._aux)
        else:
            data = arr.tobytes()
        header = msgspec.msgpack.encode((arr.dtype.str, list(arr.shape), data))
        return msgspec.msgpack.Ext(_EXT_NDARRAY, header)


class MsgpackDecoder(Generic[T]):
    """Decodes ``[payload, *out_of_band_buffers]`` into a `T`."""

    def __init__(self, type_: type[T]) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(
            type_, ext_hook=self._ext_hook
        )
        self._frames: Sequence[Frame] = ()

    def decode(self, frames: Sequence[Frame]) -> T:
        if not frames:
            raise ValueError("frames must hold at least the payload frame")
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._frames = ()

    def decode_raw(self, raw: msgspec.Raw | bytes, frames: Sequence[Frame]) -> T:
        """Decode a nested `msgspec.Raw` of a message whose frames are `frames`."""
        self._frames = frames
        try:
            return self._decoder.decode(raw)
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> object:
        if code != _EXT_NDARRAY:
            raise msgspec.DecodeError(f"unknown msgpack extension type {code}")
        dtype, shape, buf = msgspec.msgpack.decode(data, type=tuple[str, list[int], int | bytes])
        if isinstance(buf, int):
            if not 1 <= buf < len(self._frames):
                raise msgspec.DecodeError(f"array refers to missing frame {buf}")
            source: Frame = self._frames[buf]
        else:
            source = buf
        return np.frombuffer(source, dtype=np.dtype(dtype)).reshape(tuple(shape))
