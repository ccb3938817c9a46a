"""msgpack framing: boundary structs and arrays survive the trip, large arrays out of band."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from paged.scheduler.boundary import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
)
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.messages import AddRequestMessage, TensorDataRef, UtilityCall
from paged.server.engine.serial import (
    MsgpackDecoder,
    MsgpackEncoder,
    decode_add_request,
    encode_add_request,
)


def test_request_round_trip() -> None:
    req = EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=5, stop=["x"], logit_bias={3: -1.5}),
        eos_token_id=2,
        arrival_time=12.5,
        priority=3,
    )
    frames = MsgpackEncoder().encode(req)
    assert len(frames) == 1
    assert MsgpackDecoder(EngineCoreRequest).decode(frames) == req


def test_outputs_round_trip() -> None:
    lp = LogprobsLists(token_ids=[[4, 5]], logprobs=[[-0.1, -2.0]], ranks=[1])
    out = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [4], new_logprobs=lp),
            EngineCoreOutput("b", [], finish_reason=FinishReason.STOP, stop_reason="\n"),
        ],
        timestamp=3.0,
    )
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out))
    assert decoded == out
    assert decoded.outputs[1].finish_reason is FinishReason.STOP


def test_large_array_goes_out_of_band_and_decodes_without_copy() -> None:
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    frames = MsgpackEncoder(zero_copy_threshold=256).encode(UtilityCall(1, "m", [arr, "x"]))
    assert len(frames) == 2  # payload + one buffer
    assert len(frames[0]) < 100  # the payload only points at the buffer
    received = [memoryview(bytes(f)) for f in frames]  # as a socket would hand them over
    call = MsgpackDecoder(UtilityCall).decode(received)
    got = call.args[0]
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, arr)
    assert np.shares_memory(got, np.frombuffer(received[1], dtype=np.uint8))


def test_small_array_stays_inline() -> None:
    arr = np.array([1, 2, 3], dtype=np.int64)
    frames = MsgpackEncoder(zero_copy_threshold=256).encode([arr])
    assert len(frames) == 1
    (got,) = MsgpackDecoder(list[Any]).decode(frames)
    np.testing.assert_array_equal(got, arr)
    assert got.dtype == np.int64


def test_non_contiguous_array_round_trips() -> None:
    arr = np.arange(400, dtype=np.int16).reshape(20, 20)[:, ::2]
    (got,) = MsgpackDecoder(list[Any]).decode(MsgpackEncoder(zero_copy_threshold=0).encode([arr]))
    np.testing.assert_array_equal(got, arr)


def test_numpy_scalar_becomes_a_number() -> None:
    (got,) = MsgpackDecoder(list[Any]).decode(MsgpackEncoder().encode([np.float32(1.5)]))
    assert got == 1.5 and isinstance(got, float)


def test_unsupported_type_is_rejected() -> None:
    with pytest.raises(TypeError, match="object"):
        MsgpackEncoder().encode([object()])
    with pytest.raises(TypeError, match="numpy arrays of Python objects"):
        MsgpackEncoder().encode([np.array([object()])])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="zero_copy_threshold"):
        MsgpackEncoder(zero_copy_threshold=-1)
    with pytest.raises(ValueError, match="frames"):
        MsgpackDecoder(list[int]).decode([])


def test_dangling_frame_reference_is_a_decode_error() -> None:
    frames = MsgpackEncoder(zero_copy_threshold=0).encode([np.zeros(4)])
    with pytest.raises(msgspec.DecodeError, match="missing frame"):
        MsgpackDecoder(list[Any]).decode(frames[:1])


@given(
    shapes=st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=3), max_size=4),
    threshold=st.integers(0, 64),
    dtype=st.sampled_from(["float32", "int64", "uint8", "float16", "bool"]),
)
def test_arrays_round_trip_property(shapes: list[list[int]], threshold: int, dtype: str) -> None:
    rng = np.random.default_rng(0)
    arrays = [np.asarray(rng.random(s) * 100).astype(dtype) for s in shapes]
    frames = MsgpackEncoder(zero_copy_threshold=threshold).encode(arrays)
    # Exactly the arrays at or above the threshold travel out of band.
    assert len(frames) - 1 == sum(a.nbytes >= threshold for a in arrays)
    decoded = MsgpackDecoder(list[Any]).decode(frames)
    assert len(decoded) == len(arrays)
    for got, want in zip(decoded, arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def mm_request(big: bytes, small: bytes) -> EngineCoreRequest:
    def feature(i: int, data: dict[str, TensorData] | None) -> MultiModalFeatureSpec:
        return MultiModalFeatureSpec(
            "image", f"h{i}", PlaceholderRange(offset=i * 4, length=4), data
        )

    return EngineCoreRequest(
        request_id="mm",
        prompt_token_ids=list(range(12)),
        sampling_params=SamplingParams(),
        eos_token_id=None,
        arrival_time=0.0,
        mm_features=[
            feature(0, {"pixel_values": TensorData("float32", [len(big) // 4], big)}),
            feature(1, None),  # served from a cache: no data
            feature(2, {"small": TensorData("uint8", [len(small)], small)}),
        ],
    )


def test_large_multimodal_tensors_are_sent_without_copying() -> None:
    big, small = bytes(range(256)) * 16, b"tiny"
    request = mm_request(big, small)
    frames = encode_add_request(MsgpackEncoder(zero_copy_threshold=256), request)
    assert len(frames) == 2
    assert frames[1] is big  # the very bytes object: no copy on the way out
    assert len(frames[0]) < 1000  # the payload does not carry the 4 KiB
    received = [memoryview(bytes(f)) for f in frames]
    assert decode_add_request(MsgpackDecoder(AddRequestMessage), received) == request


def test_add_request_without_large_tensors_is_one_frame() -> None:
    request = mm_request(b"x" * 8, b"y")
    frames = encode_add_request(MsgpackEncoder(zero_copy_threshold=256), request)
    assert len(frames) == 1
    assert decode_add_request(MsgpackDecoder(AddRequestMessage), frames) == request
    plain = EngineCoreRequest("p", [1], SamplingParams(), None, 0.0)
    frames = encode_add_request(MsgpackEncoder(), plain)
    assert decode_add_request(MsgpackDecoder(AddRequestMessage), frames) == plain


def test_tensor_refs_to_missing_places_are_decode_errors() -> None:
    request = mm_request(b"x" * 8, b"y")
    decoder = MsgpackDecoder(AddRequestMessage)
    enc = MsgpackEncoder()
    for ref, match in [
        (TensorDataRef(5, "pixel_values"), "missing mm_features"),
        (TensorDataRef(1, "pixel_values"), "missing mm_features"),
        (TensorDataRef(0, "nope"), "missing data key"),
    ]:
        frames = [*enc.encode(AddRequestMessage(request, [ref])), b"data"]
        with pytest.raises(msgspec.DecodeError, match=match):
            decode_add_request(decoder, frames)
    with pytest.raises(msgspec.DecodeError, match="tensor frames"):
        decode_add_request(decoder, enc.encode(AddRequestMessage(request, [ref, ref])))
