"""End to end: `paged serve` on the default model enforces structured outputs.

The engine runs in its own process, so this also proves the grammar backend
is built there from `StructuredOutputConfig` (the tokenizer is loaded in the
engine process) and that the API process refuses bad constraints with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

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
    server = launch_server(
        "--max-model-len", "512", "--kv-cache-memory", "128MiB",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )  # fmt: skip
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


CITY_ARGS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
# Typed Any: the openai client's TypedDicts add nothing to a test's literals.
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": CITY_ARGS,
        },
    }
]


def test_tool_call_round_trip_with_the_openai_client(client: openai.OpenAI) -> None:
    question: Any = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.chat.completions.create(
        model=MODEL,
        messages=[question],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=60,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY_ARGS)
    # The call and its result go back; the model answers in text.
    history: Any = [
        question,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # Streamed with a named choice: the name first, then the arguments. How many
    # pieces they come in depends on timing (the output collector merges deltas
    # a slow reader has not taken yet); test_api_tools checks one piece per token.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[question],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    deltas = [
        d for chunk in stream if chunk.choices for d in chunk.choices[0].delta.tool_calls or []
    ]
    assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
    pieces = [d.function.arguments for d in deltas[1:] if d.function and d.function.arguments]
    assert pieces and all(d.function is None or not d.function.name for d in deltas[1:])
    jsonschema.validate(json.loads("".join(pieces)), CITY_ARGS)
