"""Agents with tools on the default model: `tool_choice: "auto"` through the generic format.

One live `paged serve` (the default SmolLM2-135M-Instruct, no tool flags: its chat
template ignores `tools`, so paged describes them in the system turn and constrains
the reply). Greedy decoding; the prompts are ones the 135M model handles: asked for
"How is the weather in Paris?" it calls `get_weather`, and given the tool's result it answers
with it. Each test checks that the tool really ran and that the answer uses its result.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from .conftest import LiveServer

pytestmark = pytest.mark.slow

QUESTION = "How is the weather in Paris?"
MAX_TOKENS = 64  # a reply that went astray ends quickly instead of running to max_model_len
RESULT = "sunny, 21 C"
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server(launch_server: Callable[..., LiveServer]) -> LiveServer:
    return launch_server()


def _model_name(server: LiveServer) -> str:
    models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
    name: str = models["data"][0]["id"]
    return name


def test_auto_tool_choice_calls_the_tool_and_uses_its_result(server: LiveServer) -> None:
    """Plain OpenAI requests, the round trip by hand; also the streamed call's deltas."""
    import openai

    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
        _round_trip(client, _model_name(server))


def _round_trip(client: Any, model: str) -> None:
    """Call, run the tool by hand, answer; `client` is an `openai.OpenAI`."""
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER_TOOL],
        temperature=0,
        stream=True,
        max_tokens=MAX_TOKENS,
    )
    deltas = [d for chunk in stream for d in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].type == "function"
    assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
    streamed = "".join(d.function.arguments or "" for d in deltas if d.function is not None)
    assert streamed == call.function.arguments

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    second = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls, answer
    assert "21" in (answer.message.content or ""), answer.message.content


def test_pydantic_ai_agent_uses_its_tool(server: LiveServer) -> None:
    import openai
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    provider = OpenAIProvider(openai_client=client)
    agent = Agent(
        OpenAIChatModel(_model_name(server), provider=provider),
        model_settings={"temperature": 0.0, "max_tokens": MAX_TOKENS},
    )
    cities: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        cities.append(city)
        return RESULT

    async def run() -> Any:
        async with client:  # its connections closed on the loop that opened them
            return await agent.run(QUESTION)

    result = asyncio.run(run())
    assert cities == ["Paris"]
    assert "21" in result.output, result.all_messages()


def test_langchain_bind_tools_agent_loop(server: LiveServer) -> None:
    from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    cities: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        cities.append(city)
        return RESULT

    messages: list[BaseMessage] = [HumanMessage(QUESTION)]
    with httpx.Client(timeout=300) as http_client:  # closed here, not by the collector
        llm = ChatOpenAI(
            model=_model_name(server),
            base_url=f"{server.base_url}/v1",
            api_key="unused",  # type: ignore[arg-type]
            temperature=0,
            max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
            max_retries=0,
            http_client=http_client,
        ).bind_tools([get_weather])
        for _ in range(3):  # the agent loop: call tools until the model answers
            reply = llm.invoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                output = get_weather.invoke(call["args"])
                messages.append(ToolMessage(output, tool_call_id=call["id"]))
    assert cities == ["Paris"]
    assert isinstance(messages[-1].content, str) and "21" in messages[-1].content, messages
