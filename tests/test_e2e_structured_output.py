"""End to end: `paged serve` on the default model enforces structured outputs.

The engine runs in its own process, so this also proves the grammar backend
is built there from `StructuredOutputConfig` (the tokenizer is loaded in the
engine process) and that the API process refuses bad constraints with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import jsonschema
import openai
import pydantic
import pytest

if TYPE_CHECKING:
    from tests.conftest import LiveServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=100)


@pytest.fixture(scope="module")
def client(launch_server: Callable[..., LiveServer]) -> Iterator[openai.OpenAI]:
    server = launch_server("--max-model-len", "512", "--kv-cache-memory", "128MiB")
    with openai.OpenAI(api_key="x", base_url=f"{server.base_url}/v1", max_retries=0) as c:
        yield c


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City)


def test_guided_choice_regex_and_bad_schema(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=8,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert out.choices[0].message.content in ("yes", "no")
    done = client.completions.create(
        model=MODEL, prompt="Zip code:", max_tokens=10, extra_body={"guided_regex": "[0-9]{5}"}
    )
    assert len(done.choices[0].text) == 5 and done.choices[0].text.isdigit()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A number as JSON"}],
        max_tokens=40,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"guided_json": {"type": "array", "uniqueItems": True}},
        )
    assert "uniqueItems" in str(info.value)
