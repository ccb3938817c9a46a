"""msgpack (de)serialization of engine messages, with out-of-band large buffers.

Messages are msgspec Structs encoded as msgpack. numpy arrays, which msgpack
cannot carry, are encoded through an extension type: small ones inline, those
of at least `ZERO_COPY_THRESHOLD` bytes as their own ZMQ frame that is sent
without copying (``send_multipart(copy=False)``) and decoded with
``np.frombuffer`` straight over the received frame (no copy either way).

Multimodal tensors of an `EngineCoreRequest` (`TensorData.data`, `bytes`)
of at least the threshold are sent the same way by `encode_add_request`; the
receiver copies each once into the `bytes` the boundary type requires.

Encoders and decoders keep per-message state while they run: use one per
thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from paged.multimodal.inputs import MultiModalFeatureSpec, TensorData
from paged.scheduler.boundary import EngineCoreRequest
from paged.server.engine.messages import AddRequestMessage, TensorDataRef

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
        self.zero_copy_threshold = zero_copy_threshold
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
        if arr.nbytes >= self.zero_copy_threshold and self._aux is not None:
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


def encode_add_request(encoder: MsgpackEncoder, request: EngineCoreRequest) -> list[Frame]:
    """``[payload, *array_buffers, *tensor_buffers]`` for an ADD message."""
    slim, refs, buffers = _split_tensor_data(request, encoder.zero_copy_threshold)
    return [*encoder.encode(AddRequestMessage(slim, refs)), *buffers]


def decode_add_request(
    decoder: MsgpackDecoder[AddRequestMessage], frames: Sequence[Frame]
) -> EngineCoreRequest:
    message = decoder.decode(frames)
    if not message.tensor_refs:
        return message.request
    refs = message.tensor_refs
    if len(frames) < 1 + len(refs):
        raise msgspec.DecodeError(f"ADD names {len(refs)} tensor frames, got {len(frames) - 1}")
    tail = frames[len(frames) - len(refs) :]
    by_feature: dict[int, dict[str, bytes]] = {}
    for ref, frame in zip(refs, tail, strict=True):
        by_feature.setdefault(ref.feature, {})[ref.key] = bytes(frame)
    features = list(message.request.mm_features or [])
    for index, restored in by_feature.items():
        if not 0 <= index < len(features) or features[index].data is None:
            raise msgspec.DecodeError(f"tensor ref names missing mm_features[{index}]")
        data = dict(features[index].data or {})
        for key, raw in restored.items():
            if key not in data:
                raise msgspec.DecodeError(f"tensor ref names missing data key {key!r}")
            data[key] = msgspec.structs.replace(data[key], data=raw)
        features[index] = msgspec.structs.replace(features[index], data=data)
    return msgspec.structs.replace(message.request, mm_features=features)


def _split_tensor_data(
    request: EngineCoreRequest, threshold: int
) -> tuple[EngineCoreRequest, list[TensorDataRef], list[Frame]]:
    """The request with large tensor bytes emptied, where they were, and the bytes."""
    refs: list[TensorDataRef] = []
    buffers: list[Frame] = []
    features: list[MultiModalFeatureSpec] = []
    for index, feature in enumerate(request.mm_features or []):
        if feature.data is None:
            features.append(feature)
            continue
        data: dict[str, TensorData] = {}
        for key, tensor in feature.data.items():
            if len(tensor.data) >= threshold:
                refs.append(TensorDataRef(index, key))
                buffers.append(tensor.data)
                tensor = msgspec.structs.replace(tensor, data=b"")
            data[key] = tensor
        features.append(msgspec.structs.replace(feature, data=data))
    if not refs:
        return request, [], []
    return msgspec.structs.replace(request, mm_features=features), refs, buffers
