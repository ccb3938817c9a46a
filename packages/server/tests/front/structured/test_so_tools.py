"""Tool choices `"required"` and a named function, enforced by the grammar backend.

Over a real in-process engine on the tiny random model: whatever the model's
logits, the constrained output always parses into tool calls whose arguments
satisfy the tool's `parameters` schema.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest

from paged.server.async_llm import AsyncLLM
from paged.server.openai.api_server import build_app
from paged.server.openai.tools import ToolCallingConfig

from .test_so_api import _AsyncInproc

MODEL = "tiny"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
DAYS = {
    "type": "object",
    "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_forecast", "parameters": DAYS}},
]
SCHEMAS = {"get_weather": CITY, "get_forecast": DAYS}


@pytest.fixture
async def http(tiny_llm: Any, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    llm = AsyncLLM(
        _AsyncInproc(tiny_llm.engine_client),
        tokenizer,
        max_model_len=tiny_llm.max_model_len,
        eos_token_ids=[tokenizer.eos_token_id],
        grammar_compiler=tiny_llm.grammar_compiler,
    )
    app = build_app(llm, model_name=MODEL, tool_config=ToolCallingConfig(True, "hermes"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client
    llm.shutdown()


async def _chat(http: httpx.AsyncClient, tool_choice: Any, seed: int) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 300,
        "seed": seed,
    }
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice: dict[str, Any] = resp.json()["choices"][0]
    return choice


async def test_named_tool_choice_always_yields_that_call(http: httpx.AsyncClient) -> None:
    named = {"type": "function", "function": {"name": "get_forecast"}}
    for seed in range(4):
        choice = await _chat(http, named, seed)
        assert choice["finish_reason"] == "stop", choice  # OpenAI's reason for a named choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_forecast"
        jsonschema.validate(json.loads(call["function"]["arguments"]), DAYS)


async def test_required_tool_choice_always_parses_into_valid_calls(
    http: httpx.AsyncClient,
) -> None:
    for seed in range(4):
        choice = await _chat(http, "required", seed)
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert calls, choice
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


async def test_a_tool_choice_with_another_constraint_is_a_400(http: httpx.AsyncClient) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "tool_choice"
    ok = await _chat(http, "required", 0)  # still serving
    assert ok["message"]["tool_calls"]
