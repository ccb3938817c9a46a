"""`min_tokens` is checked against the `max_tokens` default as well as an explicit one.

`SamplingParams.validate()` can only compare `min_tokens` with an explicit
`max_tokens`; the default (all that fits after the prompt) is filled in later,
so a `min_tokens` above it used to reach the engine and come back as a 500.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from paged.scheduler import SamplingParams
from paged.server.async_llm import AsyncLLM
from paged.server.errors import InvalidRequestError
from paged.server.input_processor import InputProcessor
from paged.server.llm import LLM
from paged.server.openai.api_server import build_app

MAX_MODEL_LEN = 128  # the front conftest's AsyncLLM


def test_input_processor_checks_min_tokens_against_the_default(tokenizer: Any) -> None:
    proc = InputProcessor(tokenizer, max_model_len=32)
    prompt = list(range(1, 11))  # leaves room for 22 tokens
    req, _ = proc.process_inputs("r", prompt, SamplingParams(max_tokens=None, min_tokens=22))
    assert req.sampling_params.max_tokens == 22
    with pytest.raises(InvalidRequestError) as e:
        proc.process_inputs("r", prompt, SamplingParams(max_tokens=None, min_tokens=23))
    assert e.value.param == "min_tokens"
    assert "min_tokens" in str(e.value) and "22" in str(e.value)


def test_offline_llm_raises_a_value_error_naming_min_tokens(
    tokenizer: Any, fake_engine: Any
) -> None:
    llm = LLM.from_engine_client(fake_engine, tokenizer, max_model_len=64)
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate("hello", SamplingParams(max_tokens=None, min_tokens=1000), use_tqdm=False)
    assert fake_engine.added == []


@pytest.fixture
async def http(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(llm, model_name="tiny"))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # Completions default to max_tokens=16 (OpenAI); null asks for all that fits.
        (
            "/v1/completions",
            {"prompt": "hello world", "max_tokens": None, "min_tokens": MAX_MODEL_LEN},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "min_tokens": MAX_MODEL_LEN},
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": None, "min_tokens": MAX_MODEL_LEN, "stream": True},
        ),
    ],
)
async def test_api_min_tokens_above_the_default_is_a_400(
    http: httpx.AsyncClient, fake_engine: Any, path: str, body: dict[str, Any]
) -> None:
    resp = await http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "min_tokens"
    assert err["type"] == "invalid_request_error"
    assert "min_tokens" in err["message"]
    assert fake_engine.added == []  # refused before it reached the engine
