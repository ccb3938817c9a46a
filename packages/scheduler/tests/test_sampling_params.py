"""SamplingParams.validate rejects what cannot be served, naming the field."""

from __future__ import annotations

import pytest

from paged.scheduler.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 50}, "prompt_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": -5}, "seed"),
    ],
)
def test_invalid_field_named(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs).validate()  # type: ignore[arg-type]


def test_valid_edges_pass() -> None:
    SamplingParams(top_k=-1).validate()
    SamplingParams(top_k=0, top_p=1.0, temperature=0.0, max_tokens=1).validate()
    SamplingParams(logprobs=20, prompt_logprobs=0, max_tokens=None, min_tokens=7).validate()


def test_logprobs_limit_follows_configured_max() -> None:
    SamplingParams(logprobs=5).validate(max_logprobs=5)
    with pytest.raises(ValueError, match="max_logprobs"):
        SamplingParams(logprobs=6).validate(max_logprobs=5)


def test_top_k_off_spellings_and_greedy() -> None:
    assert SamplingParams(top_k=-1).effective_top_k == 0
    assert SamplingParams(top_k=0).effective_top_k == 0
    assert SamplingParams(top_k=7).effective_top_k == 7
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams().is_greedy


def test_structured_outputs_need_exactly_one_constraint() -> None:
    from paged.scheduler import StructuredOutputsParams

    SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")).validate()
    with pytest.raises(ValueError, match="structured_outputs must set exactly one"):
        SamplingParams(structured_outputs=StructuredOutputsParams()).validate()
    with pytest.raises(ValueError, match=r"structured_outputs .*\['json', 'regex'\]"):
        SamplingParams(structured_outputs=StructuredOutputsParams(json="{}", regex="a")).validate()
    with pytest.raises(ValueError, match="choice must not be empty"):
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=[])).validate()


def test_structured_outputs_cross_the_msgpack_boundary() -> None:
    import msgspec

    from paged.scheduler import StructuredOutputsParams

    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params


def test_reasoning_ended_crosses_and_older_senders_still_decode() -> None:
    """vLLM's per-request `reasoning_ended` rides on the constraint; it is trailing and
    optional, so a message from a sender without it decodes as None (engine decides)."""
    import msgspec

    from paged.scheduler import StructuredOutputsParams

    so = StructuredOutputsParams(regex="[a-z]+", reasoning_ended=True)
    wire = msgspec.msgpack.encode(so)
    assert msgspec.msgpack.decode(wire, type=StructuredOutputsParams) == so
    old = msgspec.msgpack.encode(StructuredOutputsParams(regex="[a-z]+"))
    assert msgspec.msgpack.decode(old, type=StructuredOutputsParams).reasoning_ended is None
