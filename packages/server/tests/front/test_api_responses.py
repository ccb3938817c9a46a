"""/v1/responses over a scripted fake engine: shapes, stream events, tools, store, errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from paged.scheduler import EngineCoreRequest
from paged.server.async_llm import AsyncLLM
from paged.server.openai.api_server import build_app
from paged.server.openai.responses import ResponseStore
from paged.server.openai.tools import ToolCallingConfig
from paged.server.structured_output import GrammarCompiler, load_ll_tokenizer

from .asgi_clients import asgi_client, openai_client

MODEL = "tiny"
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
# Renders tools, assistant tool calls and tool results, so tests can read the prompt.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% for c in m.tool_calls or [] %}CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.role == 'tool' %}RESULT {{ m.tool_call_id }}: {% endif %}{{ m.content }}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Reply:
    text = "hello world"


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
    # The tokenizer is the session's: its template goes back for the other modules.
    original = tokenizer.chat_template
    tokenizer.chat_template = TOOL_TEMPLATE
    eos = [tokenizer.eos_token_id]
    compiler = GrammarCompiler(load_ll_tokenizer(tokenizer, len(tokenizer), eos), eos_token_ids=eos)
    engine = AsyncLLM(
        fake_engine, tokenizer, max_model_len=4096, eos_token_ids=eos, grammar_compiler=compiler
    )
    try:
        yield engine
    finally:
        engine.shutdown()
        tokenizer.chat_template = original


def _http(
    llm: AsyncLLM,
    store: bool = False,
    tools: ToolCallingConfig | None = None,
    reasoning: str | None = None,
) -> httpx.AsyncClient:
    app = build_app(
        llm,
        model_name=MODEL,
        tool_config=tools,
        reasoning_parser=reasoning,
        responses_store=ResponseStore(enabled=store),
    )
    return asgi_client(app)


@pytest.fixture
async def http(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    async with _http(llm) as client:
        yield client


@pytest.fixture
async def stored(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    async with _http(llm, store=True) as client:
        yield client


def _client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai_client(http)


async def _create(client: openai.AsyncOpenAI, **kwargs: Any) -> Any:
    """The openai client's call with plain dicts (its TypedDict overloads aside)."""
    return await client.responses.create(**kwargs)


def _prompt(fake_engine: Any, tokenizer: Any, i: int = -1) -> str:
    text: str = tokenizer.decode(fake_engine.added[i].prompt_token_ids)
    return text


def _events(body: str) -> list[tuple[str, dict[str, Any]]]:
    """SSE `event:` / `data:` pairs."""
    out: list[tuple[str, dict[str, Any]]] = []
    for block in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# -- text -----------------------------------------------------------------------------


async def test_create_text_response(
    http: httpx.AsyncClient, fake_engine: Any, tokenizer: Any
) -> None:
    resp = await _create(
        _client(http),
        model=MODEL,
        input="hi there",
        instructions="Be brief.",
        temperature=0.5,
        top_p=0.9,
    )
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed" and resp.incomplete_details is None
    assert resp.output_text == "hello world"
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_")
    assert [(p.type, p.text) for p in item.content] == [("output_text", "hello world")]
    assert resp.instructions == "Be brief." and resp.temperature == 0.5 and resp.top_p == 0.9
    assert resp.usage is not None
    n_out = len(tokenizer.encode("hello world", add_special_tokens=False)) + 1  # + EOS
    assert resp.usage.output_tokens == n_out
    assert resp.usage.input_tokens == len(fake_engine.added[0].prompt_token_ids)
    assert resp.usage.total_tokens == resp.usage.input_tokens + n_out
    assert resp.usage.input_tokens_details.cached_tokens == 3
    assert resp.max_output_tokens == 4096 - resp.usage.input_tokens
    prompt = _prompt(fake_engine, tokenizer)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi there")


async def test_max_output_tokens_gives_incomplete(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
    body = resp.json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert body["max_output_tokens"] == 2 and body["usage"]["output_tokens"] == 2


async def test_stream_event_order_and_sequence_numbers(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/responses", json={"input": "hi", "stream": True})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = _events(resp.text)
    kinds = [k for k, _ in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert all(e["type"] == k for k, e in events)
    assert events[0][1]["response"]["status"] == "in_progress"
    item_id = events[2][1]["item"]["id"]
    text = "".join(e["delta"] for k, e in events if k == "response.output_text.delta")
    assert text == "hello world"
    assert all(e.get("item_id", item_id) == item_id for _, e in events[3:-1])
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"][0]["id"] == item_id
    assert final["output"][0]["content"][0]["text"] == "hello world"
    assert final["usage"]["output_tokens"] > 0


async def test_openai_client_stream_helper(http: httpx.AsyncClient) -> None:
    async with _client(http).responses.stream(model=MODEL, input="hi") as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == "hello world"


async def test_stream_cut_by_max_output_tokens_ends_incomplete(http: httpx.AsyncClient) -> None:
    resp = await http.post(
        "/v1/responses", json={"input": "hi", "stream": True, "max_output_tokens": 1}
    )
    events = _events(resp.text)
    assert events[-1][0] == "response.incomplete"
    assert events[-2][1]["item"]["status"] == "incomplete"


# -- tools -----------------------------------------------------------------------------


async def test_named_tool_choice_gives_function_call(
    http: httpx.AsyncClient, reply: Reply, fake_engine: Any, tokenizer: Any
) -> None:
    reply.text = '{"city": "Paris"}'
    resp = await _create(
        _client(http),
        model=MODEL,
        input="weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (call,) = resp.output
    assert call.type == "function_call"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    assert "TOOLS: get_weather" in _prompt(fake_engine, tokenizer)
    # The call is constrained to the tool's parameters, as on the chat endpoint.
    so = fake_engine.added[-1].sampling_params.structured_outputs
    assert so is not None and json.loads(so.json) == WEATHER["parameters"]


async def test_named_tool_choice_streams_argument_events(
    http: httpx.AsyncClient, reply: Reply
) -> None:
    reply.text = '{"city": "Paris"}'
    body = {
        "input": "weather?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "stream": True,
    }
    events = _events((await http.post("/v1/responses", json=body)).text)
    kinds = [k for k, _ in events]
    n = kinds.count("response.function_call_arguments.delta")
    assert n >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * n,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2][1]["item"], events[-2][1]["item"]
    assert added["type"] == "function_call" and added["name"] == "get_weather"
    assert added["status"] == "in_progress" and added["arguments"] == ""
    args = "".join(e["delta"] for k, e in events if k.endswith("arguments.delta"))
    assert json.loads(args) == {"city": "Paris"} and done["arguments"] == args
    assert events[-3][1]["arguments"] == args and events[-3][1]["name"] == "get_weather"
    assert done["call_id"] == added["call_id"] and done["id"] == added["id"]
    assert events[-1][1]["response"]["output"] == [done]


async def test_auto_with_parser_splits_text_and_calls(llm: AsyncLLM, reply: Reply) -> None:
    reply.text = (
        'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    async with _http(llm, tools=ToolCallingConfig(True, "hermes")) as http:
        body = (await http.post("/v1/responses", json={"input": "w?", "tools": [WEATHER]})).json()
        stream = await http.post(
            "/v1/responses", json={"input": "w?", "tools": [WEATHER], "stream": True}
        )
    assert [i["type"] for i in body["output"]] == ["message", "function_call"]
    assert body["output"][0]["content"][0]["text"] == "Checking."
    assert json.loads(body["output"][1]["arguments"]) == {"city": "Oslo"}
    events = _events(stream.text)
    added = [e["item"]["type"] for k, e in events if k == "response.output_item.added"]
    assert added == ["message", "function_call"]
    final = events[-1][1]["response"]["output"]
    assert [i["type"] for i in final] == ["message", "function_call"]
    assert final[0]["status"] == "completed"


async def test_auto_without_parser_is_plain_text(http: httpx.AsyncClient, reply: Reply) -> None:
    """The Responses default is "auto": never the chat endpoint's 400; the text is a message."""
    reply.text = '<tool_call>{"name": "get_weather"}</tool_call>'
    resp = await http.post("/v1/responses", json={"input": "w?", "tools": [WEATHER]})
    assert resp.status_code == 200, resp.text
    (item,) = resp.json()["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == reply.text


async def test_function_call_and_output_fed_back(
    http: httpx.AsyncClient, fake_engine: Any, tokenizer: Any
) -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    resp = await http.post("/v1/responses", json={"input": items, "tools": [WEATHER]})
    assert resp.status_code == 200, resp.text
    prompt = _prompt(fake_engine, tokenizer)
    assert (
        '<|im_start|>assistant\nCALL call_1 get_weather {"city": "Paris"}<|im_end|>\n'
        "<|im_start|>tool\nRESULT call_1: sunny<|im_end|>"
    ) in prompt


# -- structured output ------------------------------------------------------------------


async def test_text_format_json_schema_constrains_output(
    http: httpx.AsyncClient, fake_engine: Any, reply: Reply
) -> None:
    reply.text = '{"a": 1}'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    resp = await http.post("/v1/responses", json={"input": "hi", "text": fmt})
    assert resp.status_code == 200, resp.text
    assert resp.json()["text"] == fmt
    so = fake_engine.added[-1].sampling_params.structured_outputs
    assert so is not None and json.loads(so.json) == schema


# -- store ------------------------------------------------------------------------------


async def test_store_off_nothing_is_kept(http: httpx.AsyncClient) -> None:
    created = (await http.post("/v1/responses", json={"input": "hi", "store": True})).json()
    got = await http.get(f"/v1/responses/{created['id']}")
    assert got.status_code == 404
    assert got.json()["error"] == {
        "message": f"Response with id '{created['id']}' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": None,
    }
    prev = await http.post(
        "/v1/responses", json={"input": "more", "previous_response_id": created["id"]}
    )
    assert prev.status_code == 404 and prev.json()["error"]["param"] == "response_id"
    bg = await http.post("/v1/responses", json={"input": "hi", "background": True})
    assert bg.status_code == 400 and bg.json()["error"]["param"] == "background"
    assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in bg.json()["error"]["message"]


async def test_store_on_retrieve_and_continue(
    stored: httpx.AsyncClient, fake_engine: Any, tokenizer: Any
) -> None:
    first = (await stored.post("/v1/responses", json={"input": "hi", "instructions": "S1"})).json()
    got = await stored.get(f"/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json() == first
    second = await stored.post(
        "/v1/responses",
        json={"input": "again", "previous_response_id": first["id"], "instructions": "S2"},
    )
    assert second.json()["previous_response_id"] == first["id"]
    prompt = _prompt(fake_engine, tokenizer)
    # Old instructions do not carry over; the earlier turn and its answer do.
    assert "S1" not in prompt
    assert prompt.startswith(
        "<|im_start|>system\nS2<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello world<|im_end|>\n<|im_start|>user\nagain"
    )
    cancel = await stored.post(f"/v1/responses/{first['id']}/cancel")
    assert cancel.status_code == 400
    assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
    nostore = (await stored.post("/v1/responses", json={"input": "x", "store": False})).json()
    assert (await stored.get(f"/v1/responses/{nostore['id']}")).status_code == 404


async def test_background_runs_and_can_be_polled(stored: httpx.AsyncClient) -> None:
    queued = (await stored.post("/v1/responses", json={"input": "hi", "background": True})).json()
    assert queued["status"] == "queued" and queued["background"] is True
    assert queued["output"] == [] and queued["usage"] is None
    for _ in range(200):
        body = (await stored.get(f"/v1/responses/{queued['id']}")).json()
        if body["status"] == "completed":
            break
        await asyncio.sleep(0.01)
    assert body["status"] == "completed" and body["output"][0]["content"][0]["text"]


async def test_background_cancel(llm: AsyncLLM, fake_engine: Any) -> None:
    fake_engine.step_delay = 0.05  # slow enough to cancel mid-way
    async with _http(llm, store=True) as http:
        queued = (
            await http.post(
                "/v1/responses", json={"input": "hi", "background": True, "max_output_tokens": 50}
            )
        ).json()
        await asyncio.sleep(0.1)
        cancelled = await http.post(f"/v1/responses/{queued['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        await asyncio.sleep(0.1)
        assert (await http.get(f"/v1/responses/{queued['id']}")).json()["status"] == "cancelled"
    assert fake_engine.aborted  # the engine request was aborted


async def test_background_needs_store_true(stored: httpx.AsyncClient) -> None:
    resp = await stored.post(
        "/v1/responses", json={"input": "hi", "background": True, "store": False}
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "background can only be used when `store` is true"


# -- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "computer_call"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{**WEATHER, "parameters": 3}]}, "tools[0].parameters"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        (
            {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
        ),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "temperature": 3.0}, "temperature"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
        ({"input": 5}, "input"),
        ({"input": "hello " * 5000}, "input"),  # longer than max_model_len
        ({}, "input"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(
    http: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    resp = await http.post("/v1/responses", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


async def test_unknown_model_is_404(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/responses", json={"input": "x", "model": "other"})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"


# -- logprobs, vLLM's structured_outputs, background streams ------------------------------


async def test_output_text_logprobs(http: httpx.AsyncClient, tokenizer: Any) -> None:
    body = {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    part = (await http.post("/v1/responses", json=body)).json()["output"][0]["content"][0]
    n = len(tokenizer.encode("hello world", add_special_tokens=False))
    assert len(part["logprobs"]) >= n
    first = part["logprobs"][0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(first["top_logprobs"]) == 2 and first["bytes"] == list(first["token"].encode())
    events = _events((await http.post("/v1/responses", json={**body, "stream": True})).text)
    deltas = [e for k, e in events if k == "response.output_text.delta"]
    assert all(
        set(lp) == {"token", "logprob", "top_logprobs"} for d in deltas for lp in d["logprobs"]
    )
    # The EOS token has no text, so no delta carries it (vLLM skips empty deltas too).
    assert sum(len(d["logprobs"]) for d in deltas) == len(part["logprobs"]) - 1
    assert part["logprobs"][-1]["token"] == "<|im_end|>"
    # Without `include`, no logprobs are asked of the engine.
    plain = (await http.post("/v1/responses", json={"input": "hi"})).json()
    assert plain["output"][0]["content"][0]["logprobs"] is None


async def test_vllm_structured_outputs_field(http: httpx.AsyncClient, fake_engine: Any) -> None:
    resp = await http.post(
        "/v1/responses", json={"input": "hi", "structured_outputs": {"regex": "hello world"}}
    )
    assert resp.status_code == 200, resp.text
    assert fake_engine.added[-1].sampling_params.structured_outputs.regex == "hello world"
    both = await http.post(
        "/v1/responses",
        json={
            "input": "hi",
            "structured_outputs": {"regex": "a"},
            "text": {"format": {"type": "json_object"}},
        },
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "structured_outputs"


async def test_background_stream_and_replay(stored: httpx.AsyncClient) -> None:
    body = {"input": "hi", "background": True, "stream": True}
    live = _events((await stored.post("/v1/responses", json=body)).text)
    assert live[0][0] == "response.created" and live[-1][0] == "response.completed"
    rid = live[0][1]["response"]["id"]
    replay = _events((await stored.get(f"/v1/responses/{rid}?stream=true")).text)
    assert replay == live
    tail = _events((await stored.get(f"/v1/responses/{rid}?stream=true&starting_after=3")).text)
    assert tail == live[4:]
    done = (await stored.get(f"/v1/responses/{rid}")).json()
    assert done["status"] == "completed" and done["output"] == live[-1][1]["response"]["output"]
    # Only background streams keep their events (vLLM: "Unknown response_id").
    plain = (await stored.post("/v1/responses", json={"input": "hi"})).json()
    again = await stored.get(f"/v1/responses/{plain['id']}?stream=true")
    assert again.status_code == 400 and again.json()["error"]["param"] == "response_id"


async def test_required_tool_choice_with_parallel_calls_off(
    http: httpx.AsyncClient, reply: Reply
) -> None:
    reply.text = (
        '[{"name": "get_weather", "parameters": {"city": "Rome"}}, '
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    )
    body: dict[str, Any] = {"input": "w?", "tools": [WEATHER], "tool_choice": "required"}
    both = (await http.post("/v1/responses", json=body)).json()["output"]
    assert [json.loads(i["arguments"]) for i in both] == [{"city": "Rome"}, {"city": "Oslo"}]
    assert len({i["call_id"] for i in both}) == 2
    one = {**body, "parallel_tool_calls": False}
    assert len((await http.post("/v1/responses", json=one)).json()["output"]) == 1
    events = _events((await http.post("/v1/responses", json={**one, "stream": True})).text)
    final = events[-1][1]["response"]
    assert final["parallel_tool_calls"] is False
    assert [json.loads(i["arguments"]) for i in final["output"]] == [{"city": "Rome"}]
    streamed = _events((await http.post("/v1/responses", json={**body, "stream": True})).text)
    added = [e["output_index"] for k, e in streamed if k == "response.output_item.added"]
    assert added == [0, 1]


async def test_background_bad_input_is_a_400_not_a_failed_response(
    stored: httpx.AsyncClient,
) -> None:
    resp = await stored.post("/v1/responses", json={"input": "hello " * 5000, "background": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input"


# -- reasoning (--reasoning-parser) -------------------------------------------------------

THOUGHT = "<think>Two plus two.</think>It is 4."
_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _types(output: list[dict[str, Any]]) -> list[str]:
    return [item["type"] for item in output]


async def test_reasoning_item_comes_before_the_message(llm: AsyncLLM, reply: Reply) -> None:
    reply.text = THOUGHT
    async with _http(llm, reasoning="deepseek_r1") as http:
        resp = await _create(_client(http), model=MODEL, input="2+2?")
        hidden = await http.post(
            "/v1/responses", json={"input": "2+2?", "include_reasoning": False}
        )
    assert resp.output_text == "It is 4." and [i.type for i in resp.output] == [
        "reasoning",
        "message",
    ]
    thought = resp.output[0].model_dump()
    assert thought["id"].startswith("rs_") and thought["summary"] == []
    assert thought["content"] == [{"type": "reasoning_text", "text": "Two plus two."}]
    assert "<think>" not in resp.model_dump_json()
    # include_reasoning=false: vLLM still lets the model think, and leaves the item out.
    assert _types(hidden.json()["output"]) == ["message"]
    assert hidden.json()["output"][0]["content"][0]["text"] == "It is 4."


async def test_without_a_reasoning_parser_there_is_no_reasoning_item(
    http: httpx.AsyncClient, reply: Reply
) -> None:
    reply.text = THOUGHT
    (item,) = (await http.post("/v1/responses", json={"input": "2+2?"})).json()["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == THOUGHT


async def test_streamed_reasoning_events_come_before_the_message(
    llm: AsyncLLM, reply: Reply
) -> None:
    reply.text = THOUGHT
    async with _http(llm, reasoning="deepseek_r1") as http:
        resp = await http.post("/v1/responses", json={"input": "2+2?", "stream": True})
        hidden = await http.post(
            "/v1/responses", json={"input": "2+2?", "stream": True, "include_reasoning": False}
        )
    events = _events(resp.text)
    kinds = [k for k, _ in events]
    thinks = kinds.count("response.reasoning_text.delta")
    says = kinds.count("response.output_text.delta")
    assert thinks >= 2 and says >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * thinks,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * says,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    by_kind = {k: e for k, e in events}
    assert by_kind["response.reasoning_text.done"]["text"] == "Two plus two."
    assert by_kind["response.output_text.done"]["text"] == "It is 4."
    added = [e for k, e in events if k == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [
        (0, "reasoning"),
        (1, "message"),
    ]
    final = events[-1][1]["response"]["output"]
    assert _types(final) == ["reasoning", "message"]
    assert final[0]["content"][0]["text"] == "Two plus two." and final[0]["status"] == "completed"
    assert "think>" not in resp.text and "</th" not in resp.text
    hidden_kinds = [k for k, _ in _events(hidden.text)]
    assert "response.reasoning_text.delta" not in hidden_kinds and "Two plus" not in hidden.text


async def test_tool_calls_are_read_from_the_answer_only(llm: AsyncLLM, reply: Reply) -> None:
    body: dict[str, Any] = {"input": "w?", "tools": [WEATHER]}
    async with _http(llm, tools=ToolCallingConfig(True, "hermes"), reasoning="deepseek_r1") as http:
        reply.text = f"<think>maybe {_CALL}</think>No call needed."
        mused = (await http.post("/v1/responses", json=body)).json()["output"]
        reply.text = f"<think>I will call it.</think>{_CALL}"
        called = (await http.post("/v1/responses", json=body)).json()["output"]
        streamed = _events((await http.post("/v1/responses", json={**body, "stream": True})).text)
    assert _types(mused) == ["reasoning", "message"]
    assert mused[1]["content"][0]["text"] == "No call needed."
    assert _types(called) == ["reasoning", "function_call"]
    assert called[0]["content"][0]["text"] == "I will call it."
    assert json.loads(called[1]["arguments"]) == {"city": "Paris"}
    added = [e["item"]["type"] for k, e in streamed if k == "response.output_item.added"]
    assert added == ["reasoning", "function_call"]
    assert _types(streamed[-1][1]["response"]["output"]) == ["reasoning", "function_call"]


async def test_text_format_constrains_the_answer_only(
    llm: AsyncLLM, reply: Reply, fake_engine: Any
) -> None:
    """The engine's grammar waits for the end of the thinking (reasoning_ended None);
    with no thinking (qwen3, reasoning.effort "none") it holds from the first token."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    body: dict[str, Any] = {"input": "hi", "text": fmt}
    reply.text = '<think>An object.</think>{"a": 1}'
    async with _http(llm, reasoning="deepseek_r1") as http:
        output = (await http.post("/v1/responses", json=body)).json()["output"]
    assert _types(output) == ["reasoning", "message"]
    assert json.loads(output[1]["content"][0]["text"]) == {"a": 1}
    assert fake_engine.added[-1].sampling_params.structured_outputs.reasoning_ended is None
    reply.text = '{"a": 2}'
    async with _http(llm, reasoning="qwen3") as http:
        off = await http.post("/v1/responses", json={**body, "reasoning": {"effort": "none"}})
        assert fake_engine.added[-1].sampling_params.structured_outputs.reasoning_ended is True
        on = await http.post("/v1/responses", json={**body, "reasoning": {"effort": "high"}})
        assert fake_engine.added[-1].sampling_params.structured_outputs.reasoning_ended is None
    assert _types(off.json()["output"]) == ["message"]
    assert off.json()["reasoning"] == {"effort": "none"}
    # Thinking on: qwen3's output is thinking until its end tag (here: all of it).
    assert _types(on.json()["output"]) == ["reasoning"]


async def test_background_and_stored_responses_keep_the_reasoning(
    llm: AsyncLLM, reply: Reply, fake_engine: Any, tokenizer: Any
) -> None:
    reply.text = THOUGHT
    async with _http(llm, store=True, reasoning="deepseek_r1") as http:
        queued = await http.post("/v1/responses", json={"input": "hi", "background": True})
        rid = queued.json()["id"]
        for _ in range(200):
            body = (await http.get(f"/v1/responses/{rid}")).json()
            if body["status"] == "completed":
                break
            await asyncio.sleep(0.01)
        live = (await http.post("/v1/responses", json={"input": "hi", "stream": True})).text
        streamed = _events(live)[-1][1]["response"]
        got = (await http.get(f"/v1/responses/{streamed['id']}")).json()
        await http.post("/v1/responses", json={"input": "more", "previous_response_id": rid})
    assert body["status"] == "completed" and _types(body["output"]) == ["reasoning", "message"]
    assert body["output"][0]["content"][0]["text"] == "Two plus two."
    assert _types(got["output"]) == ["reasoning", "message"] and got == streamed
    # vLLM leaves a previous response's reasoning out of the next prompt (utils.py:288).
    prompt = _prompt(fake_engine, tokenizer)
    assert "It is 4." in prompt and "Two plus two." not in prompt


async def test_reasoning_input_items_and_effort_reach_the_template(
    llm: AsyncLLM, fake_engine: Any, tokenizer: Any
) -> None:
    template = (
        "effort={{ reasoning_effort }} thinking={{ enable_thinking }}\n"
        "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content or '' }}|"
        "{{ m.reasoning or '' }}|{{ m.content }}\n{% endfor %}"
    )
    items = [
        {"role": "user", "content": "hi"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "old thought"}],
        },
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "next"},
    ]
    tokenizer.chat_template = template
    try:
        async with _http(llm, reasoning="qwen3") as http:
            body = {"input": items, "max_output_tokens": 1, "reasoning": {"effort": "low"}}
            assert (await http.post("/v1/responses", json=body)).status_code == 200
            prompt = _prompt(fake_engine, tokenizer)
            kwargs = {"enable_thinking": True}
            both = {**body, "chat_template_kwargs": kwargs, "reasoning": {"effort": "none"}}
            assert (await http.post("/v1/responses", json=both)).status_code == 200
            kept = _prompt(fake_engine, tokenizer)
            bad = await http.post("/v1/responses", json={**body, "reasoning": {"effort": "huge"}})
    finally:
        tokenizer.chat_template = TOOL_TEMPLATE
    assert prompt.startswith("effort=low thinking=True\n")
    assert "assistant:old thought|old thought|A\n" in prompt
    # The request's own enable_thinking wins over the effort's (vLLM's build_chat_params).
    assert kept.startswith("effort=none thinking=True\n")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning.effort"
