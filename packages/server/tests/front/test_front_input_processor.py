"""InputProcessor: tokenization, validation naming the field, max_tokens defaults."""

from __future__ import annotations

from typing import Any

import pytest

from paged.scheduler import SamplingParams
from paged.server.chat_utils import apply_chat_template
from paged.server.errors import ContextLengthError, InvalidRequestError
from paged.server.input_processor import InputProcessor


@pytest.fixture
def proc(tokenizer: Any) -> InputProcessor:
    return InputProcessor(tokenizer, max_model_len=32)


def test_text_prompt_tokenized_and_max_tokens_filled(proc: InputProcessor, tokenizer: Any) -> None:
    req, text = proc.process_inputs("r1", "hello world", SamplingParams(max_tokens=None))
    assert text == "hello world"
    assert req.prompt_token_ids == tokenizer.encode("hello world")
    assert req.sampling_params.max_tokens == 32 - len(req.prompt_token_ids)
    assert req.eos_token_id == tokenizer.eos_token_id
    assert req.request_id == "r1"


def test_token_prompts(proc: InputProcessor) -> None:
    req, text = proc.process_inputs("r", [5, 6, 7], SamplingParams())
    assert req.prompt_token_ids == [5, 6, 7] and text is None
    req, text = proc.process_inputs(
        "r", {"prompt_token_ids": [1, 2], "prompt": "x"}, SamplingParams()
    )
    assert req.prompt_token_ids == [1, 2] and text == "x"


@pytest.mark.parametrize(
    ("prompt", "param"),
    [([1, 10_000], "prompt"), ([1, -1], "prompt"), ([], "prompt"), ("", "prompt")],
)
def test_bad_prompts_name_the_field(proc: InputProcessor, prompt: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        proc.process_inputs("r", prompt, SamplingParams())
    assert e.value.param == param


def test_prompt_too_long(proc: InputProcessor) -> None:
    with pytest.raises(ContextLengthError) as e:
        proc.process_inputs("r", list(range(1, 33)), SamplingParams(max_tokens=None))
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    assert "32" in str(e.value)


def test_max_tokens_that_cannot_fit(proc: InputProcessor) -> None:
    with pytest.raises(ContextLengthError) as e:
        proc.process_inputs("r", list(range(1, 11)), SamplingParams(max_tokens=23))
    assert e.value.param == "max_tokens"
    req, _ = proc.process_inputs("r", list(range(1, 11)), SamplingParams(max_tokens=22))
    assert req.sampling_params.max_tokens == 22


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(n=0), "n"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(stop=[""]), "stop"),
        (SamplingParams(stop_token_ids=[999]), "stop_token_ids"),
        (SamplingParams(logit_bias={999: 1.0}), "logit_bias"),
        (SamplingParams(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_params_name_the_field(
    proc: InputProcessor, params: SamplingParams, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        proc.process_inputs("r", "hello", params)
    assert e.value.param == param
    assert isinstance(e.value, ValueError)


def test_chat_template_rendering(tokenizer: Any) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    text = apply_chat_template(tokenizer, msgs)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert "a\nb" in apply_chat_template(tokenizer, parts)
    assert apply_chat_template(tokenizer, msgs, add_generation_prompt=False).endswith(
        "<|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_chat_messages(tokenizer: Any, messages: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        apply_chat_template(tokenizer, messages)
    assert e.value.param == param
