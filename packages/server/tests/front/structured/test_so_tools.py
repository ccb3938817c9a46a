"""Tool choices `"required"` and a named function, enforced by the grammar backend.

Over a real in-process engine on the tiny random model: whatever the model's
logits, the constrained output always parses into tool calls whose arguments
satisfy the tool's `parameters` schema.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest

from paged.server.async_llm import AsyncLLM
from paged.server.openai.api_server import build_app
from paged.server.openai.tools import ToolCallingConfig

from ..asgi_clients import asgi_client
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


class _PacedInproc(_AsyncInproc):
    """One engine step per 10 ms, so the SSE reader keeps up and deltas are not merged."""

    async def get_output_async(self) -> Any:
        await asyncio.sleep(0.01)
        return await super().get_output_async()


async def test_streamed_required_call_arguments_arrive_in_pieces(
    tiny_llm: Any, tokenizer: Any
) -> None:
    llm = AsyncLLM(
        _PacedInproc(tiny_llm.engine_client),
        tokenizer,
        max_model_len=tiny_llm.max_model_len,
        eos_token_ids=[tokenizer.eos_token_id],
        grammar_compiler=tiny_llm.grammar_compiler,
    )
    app = build_app(llm, model_name=MODEL, tool_config=ToolCallingConfig(True, "hermes"))
    async with asgi_client(app) as http:
        await _stream_required_call(http)
    llm.shutdown()


async def _stream_required_call(http: httpx.AsyncClient) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 300,
        "seed": 1,
        "stream": True,
    }
    pieces: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    finish = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            finish = choice.get("finish_reason") or finish
            for d in choice["delta"].get("tool_calls") or []:
                if d.get("id"):
                    names[d["index"]] = d["function"]["name"]
                pieces.setdefault(d["index"], []).append(d["function"].get("arguments", ""))
    assert finish == "tool_calls" and names
    for index, name in names.items():
        args = "".join(pieces[index])
        jsonschema.validate(json.loads(args), SCHEMAS[name])
        # Token by token: the arguments came in more than one non-empty piece.
        assert len([p for p in pieces[index] if p]) > 1, pieces[index]


TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' }}"
    "{% for t in tools %}{{ t['function']['name'] + ' ' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


async def test_tokenize_renders_tools_in_the_chat_form(tiny_llm: Any, tokenizer: Any) -> None:
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    llm = AsyncLLM(
        _AsyncInproc(tiny_llm.engine_client),
        tok,
        max_model_len=tiny_llm.max_model_len,
        eos_token_ids=[tok.eos_token_id],
        grammar_compiler=tiny_llm.grammar_compiler,
    )
    app = build_app(llm, model_name=MODEL)
    async with asgi_client(app) as http:
        messages = [{"role": "user", "content": "hi"}]
        plain = await http.post("/tokenize", json={"messages": messages})
        with_tools = await http.post("/tokenize", json={"messages": messages, "tools": TOOLS})
        assert plain.status_code == with_tools.status_code == 200, with_tools.text
        text = tok.decode(with_tools.json()["tokens"])
        assert "Tools: get_weather get_forecast" in text
        assert with_tools.json()["count"] > plain.json()["count"]
        bad = await http.post("/tokenize", json={"messages": messages, "tools": [{"type": "x"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].type"
        bare = await http.post("/tokenize", json={"prompt": "hi", "tools": TOOLS})
        assert bare.status_code == 400 and bare.json()["error"]["param"] == "tools"
    llm.shutdown()


def test_llm_chat_hands_tools_to_the_template(tiny_llm: Any) -> None:
    from paged.scheduler import SamplingParams

    messages = [{"role": "user", "content": "hi"}]
    out = tiny_llm.chat(
        messages,
        SamplingParams(max_tokens=1),
        tools=TOOLS,
        chat_template=TOOLS_TEMPLATE,
        use_tqdm=False,
    )
    prompt = tiny_llm.get_tokenizer().decode(out[0].prompt_token_ids)
    assert "Tools: get_weather get_forecast" in prompt
    with pytest.raises(ValueError, match=r"tools\[0\].function"):
        tiny_llm.chat(messages, tools=[{"type": "function"}], use_tqdm=False)
