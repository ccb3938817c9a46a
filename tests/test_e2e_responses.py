"""End to end: /v1/responses on the default model, with the openai client and openai-agents.

One server (store enabled, as `VLLM_ENABLE_RESPONSES_API_STORE=1` does for
vLLM); generations are short and greedy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import openai
import pytest

if TYPE_CHECKING:
    from tests.conftest import LiveServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(launch_server: Callable[..., LiveServer]) -> Iterator[LiveServer]:
    old = os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE")
    os.environ["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"  # the child inherits it
    try:
        yield launch_server("--max-model-len", "1024", "--kv-cache-memory", "128MiB")
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_RESPONSES_API_STORE", None)
        else:
            os.environ["VLLM_ENABLE_RESPONSES_API_STORE"] = old


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(api_key="unused", base_url=f"{server.base_url}/v1", max_retries=0) as c:
        yield c


def test_create_stream_retrieve_and_continue(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    assert resp.status in ("completed", "incomplete")
    assert "Paris" in resp.output_text
    assert resp.usage is not None and 0 < resp.usage.output_tokens <= 16
    assert client.responses.retrieve(resp.id).output_text == resp.output_text

    with client.responses.stream(
        model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{final.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == resp.output_text  # greedy: the same text streamed

    follow = client.responses.create(
        model=MODEL,
        input="And of Germany?",
        previous_response_id=resp.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert follow.previous_response_id == resp.id and follow.output_text
    assert follow.usage is not None and resp.usage is not None
    # The earlier turn is part of the prompt.
    assert follow.usage.input_tokens > resp.usage.input_tokens + resp.usage.output_tokens


async def test_openai_agents_tool_round_trip(server: LiveServer) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    aclient = openai.AsyncOpenAI(api_key="unused", base_url=f"{server.base_url}/v1", max_retries=0)
    agent: Agent[Any] = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=aclient),
        # The 135M model would not choose the tool: force it for the first turn
        # (the SDK resets tool_choice after a tool ran, so the second turn answers,
        # as `{"response": ...}` in the generic tool format: room for the JSON).
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=128),
    )
    try:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    finally:
        await aclient.close()
    assert len(calls) == 1 and calls[0]
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
    call = result.new_items[0].raw_item
    assert json.loads(getattr(call, "arguments", "{}")) == {"city": calls[0]}
    assert isinstance(result.final_output, str) and result.final_output
