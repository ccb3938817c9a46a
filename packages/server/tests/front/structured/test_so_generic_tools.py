"""The generic tool format enforced by the grammar backend, on the tiny random model.

Whatever the random logits, an `"auto"` reply is either valid calls (arguments
satisfying the tool's schema) or a non-empty plain answer, never raw JSON;
`"required"` always gives valid calls.
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
from .test_so_tools import SCHEMAS, TOOLS


@pytest.fixture
async def http(tiny_llm: Any, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    llm = AsyncLLM(
        _AsyncInproc(tiny_llm.engine_client),
        tokenizer,
        max_model_len=tiny_llm.max_model_len,
        eos_token_ids=[tokenizer.eos_token_id],
        grammar_compiler=tiny_llm.grammar_compiler,
    )
    app = build_app(llm, model_name="tiny", tool_config=ToolCallingConfig())  # no flags
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
        "temperature": 1.0,
    }
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice: dict[str, Any] = resp.json()["choices"][0]
    return choice


def _check_calls(choice: dict[str, Any]) -> None:
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]  # one call: parallel calls were not asked
    name = call["function"]["name"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


async def test_auto_is_a_valid_call_or_a_plain_answer(http: httpx.AsyncClient) -> None:
    for seed in range(6):
        choice = await _chat(http, "auto", seed)
        if choice["message"].get("tool_calls"):
            _check_calls(choice)
        elif choice["finish_reason"] == "stop":
            content = choice["message"]["content"]
            assert content and not content.lstrip().startswith('{"'), choice


async def test_required_is_always_a_valid_call(http: httpx.AsyncClient) -> None:
    for seed in range(4):
        _check_calls(await _chat(http, "required", seed))
