"""msgpack framing: boundary structs and arrays survive the trip, large arrays out of band."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged.scheduler.boundary import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
)
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.messages import UtilityCall
from paged.server.engine.serial import MsgpackDecoder, MsgpackEncoder


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
