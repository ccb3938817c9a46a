"""The generic tool format through the HTTP API (scripted fake engine, tools-ignoring template).

The tiny tokenizer's ChatML template ignores `tools`, as the default model's does,
so with no tool flags `tool_choice: "auto"` uses the generic format.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from paged.scheduler import EngineCoreRequest
from paged.server.async_llm import AsyncLLM
from paged.server.openai.api_server import build_app
from paged.server.openai.tools import ToolCallingConfig
from paged.server.structured_output import GrammarCompiler, load_ll_tokenizer

from .asgi_clients import asgi_client, openai_client

MODEL = "tiny"
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
USER = [{"role": "user", "content": "weather in Paris?"}]
CALL = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}'


class Reply:
    text = ""


@pytest.fixture
def reply() -> Reply:
    return Reply()


@pytest.fixture
def fake_engine(engine_cls: Any, tokenizer: Any, reply: Reply) -> Any:
    def script(req: EngineCoreRequest) -> list[int]:
        ids: list[int] = tokenizer.encode(reply.text, add_special_tokens=False)
        return [*ids, tokenizer.eos_token_id]

    return engine_cls(script=script)


@pytest.fixture
async def llm(tokenizer: Any, fake_engine: Any) -> AsyncIterator[AsyncLLM]:
    eos = [tokenizer.eos_token_id]
    compiler = GrammarCompiler(load_ll_tokenizer(tokenizer, len(tokenizer), eos), eos_token_ids=eos)
    engine = AsyncLLM(
        fake_engine, tokenizer, max_model_len=8192, eos_token_ids=eos, grammar_compiler=compiler
    )
    yield engine
    engine.shutdown()


async def _http(llm: AsyncLLM, config: ToolCallingConfig) -> httpx.AsyncClient:
    app = build_app(llm, model_name=MODEL, tool_config=config)
    return asgi_client(app)


@pytest.fixture
async def http(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    async with await _http(llm, ToolCallingConfig()) as client:  # no tool flags at all
        yield client


@pytest.fixture
def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai_client(http)


async def _create(client: openai.AsyncOpenAI, **kwargs: Any) -> Any:
    return await client.chat.completions.create(**kwargs)


async def test_auto_call_without_flags(
    client: openai.AsyncOpenAI, reply: Reply, fake_engine: Any, tokenizer: Any
) -> None:
    reply.text = CALL
    resp = await _create(client, model=MODEL, messages=USER, tools=[WEATHER])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    # The model saw the tools in the system turn, and the reply was constrained.
    added = fake_engine.added[0]
    prompt = tokenizer.decode(added.prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nYou can call these tools:\n")
    assert '{"name": "get_weather", "description": "Weather in a city"' in prompt
    schema = json.loads(added.sampling_params.structured_outputs.json)
    assert [set(branch["required"]) for branch in schema["anyOf"]] == [
        {"tool_calls"},
        {"response"},
    ]


async def test_auto_answer_is_content(client: openai.AsyncOpenAI, reply: Reply) -> None:
    reply.text = '{"response":"It is \\"sunny\\"."}'
    resp = await _create(client, model=MODEL, messages=USER, tools=[WEATHER])
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == 'It is "sunny".' and not choice.message.tool_calls


async def test_streamed_call_and_streamed_answer(client: openai.AsyncOpenAI, reply: Reply) -> None:
    reply.text = CALL
    stream = await _create(client, model=MODEL, messages=USER, tools=[WEATHER], stream=True)
    chunks = [c async for c in stream]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    first = deltas[0]
    assert first.id and first.type == "function" and first.index == 0
    assert first.function is not None and first.function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas if d.function is not None)
    assert json.loads(args) == {"city": "Paris"}
    assert all(d.id is None for d in deltas[1:])
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    reply.text = '{"response":"Sunny and warm."}'
    stream = await _create(client, model=MODEL, messages=USER, tools=[WEATHER], stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sunny and warm."
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_required_and_named_use_the_generic_shape(
    http: httpx.AsyncClient, reply: Reply, fake_engine: Any
) -> None:
    reply.text = CALL
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        body = {"messages": USER, "tools": [WEATHER], "tool_choice": choice}
        resp = await http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        message = resp.json()["choices"][0]["message"]
        assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
        schema = json.loads(fake_engine.added[-1].sampling_params.structured_outputs.json)
        assert schema["required"] == ["tool_calls"]  # no plain answer allowed


async def test_round_trip_renders_as_text(
    http: httpx.AsyncClient, reply: Reply, fake_engine: Any, tokenizer: Any
) -> None:
    reply.text = '{"response":"Sunny, 21 C."}'
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    resp = await http.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "Sunny, 21 C."
    prompt = tokenizer.decode(fake_engine.added[0].prompt_token_ids)
    assert (
        '<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}]}<|im_end|>\n'
        "<|im_start|>user\nResult of get_weather: sunny, 21 C<|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in prompt


async def test_a_named_parser_keeps_its_own_path(
    llm: AsyncLLM, reply: Reply, fake_engine: Any, tokenizer: Any
) -> None:
    reply.text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    async with await _http(llm, ToolCallingConfig(True, "hermes")) as http:
        resp = await http.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]})
    assert resp.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == (
        "get_weather"
    )
    added = fake_engine.added[0]
    assert added.sampling_params.structured_outputs is None
    assert "You can call these tools" not in tokenizer.decode(added.prompt_token_ids)


async def test_generic_with_another_constraint_is_a_400(http: httpx.AsyncClient) -> None:
    body = {"messages": USER, "tools": [WEATHER], "response_format": {"type": "json_object"}}
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "tool_choice"
