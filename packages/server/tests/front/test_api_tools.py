"""Tool calling through the HTTP API over a scripted fake engine (openai client and raw SSE)."""

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
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "weather in Paris?"}]
TWO_CALLS = (
    "Checking.\n"
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
# A template that renders tools, assistant tool calls and tool results.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}="
    "{{ t.function.parameters | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% for c in m.tool_calls or [] %}CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.role == 'tool' %}RESULT {{ m.tool_call_id }}: {% endif %}{{ m.content }}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def _create(client: openai.AsyncOpenAI, **kwargs: Any) -> Any:
    """The openai client's call with plain dicts (its TypedDict overloads aside)."""
    return await client.chat.completions.create(**kwargs)


class Reply:
    """The text the scripted engine answers every request with (then EOS)."""

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
    # Rendered tools make long prompts for a 400-token vocabulary.
    # A real compiler: the frontend compiles a tool choice's schema before submitting it
    # (the scripted engine then answers without a mask).
    eos = [tokenizer.eos_token_id]
    compiler = GrammarCompiler(load_ll_tokenizer(tokenizer, len(tokenizer), eos), eos_token_ids=eos)
    engine = AsyncLLM(
        fake_engine,
        tokenizer,
        max_model_len=4096,
        eos_token_ids=eos,
        grammar_compiler=compiler,
    )
    yield engine
    engine.shutdown()


async def _http(llm: AsyncLLM, config: ToolCallingConfig) -> httpx.AsyncClient:
    app = build_app(llm, model_name=MODEL, tool_config=config)
    return asgi_client(app)


@pytest.fixture
async def http(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    async with await _http(llm, ToolCallingConfig(True, "hermes")) as client:
        yield client


@pytest.fixture
def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai_client(http)


async def test_auto_tool_calls_non_streaming(client: openai.AsyncOpenAI, reply: Reply) -> None:
    reply.text = TWO_CALLS
    resp = await _create(
        client,
        model=MODEL,
        messages=USER,
        tools=[WEATHER, TIME],
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n\n"
    calls = choice.message.tool_calls or []
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_time", {}),
    ]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert len({c.id for c in calls}) == 2


async def test_no_call_is_plain_content(http: httpx.AsyncClient, reply: Reply) -> None:
    reply.text = 'Sunny. <tool_call>{"name": broken</tool_call>'
    resp = await http.post(
        "/v1/chat/completions", json={"messages": USER, "tools": [WEATHER], "tool_choice": "auto"}
    )
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": reply.text}  # no tool_calls key
    assert choice["finish_reason"] == "stop"


async def test_only_calls_gives_null_content(http: httpx.AsyncClient, reply: Reply) -> None:
    reply.text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    resp = await http.post("/v1/chat/completions", json={"messages": USER, "tools": [TIME]})
    message = resp.json()["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert set(message["tool_calls"][0]) == {"id", "type", "function"}


async def test_parallel_tool_calls_false_keeps_the_first(
    client: openai.AsyncOpenAI, reply: Reply
) -> None:
    reply.text = TWO_CALLS
    resp = await _create(
        client,
        model=MODEL,
        messages=USER,
        tools=[WEATHER, TIME],
        parallel_tool_calls=False,
    )
    assert [c.function.name for c in resp.choices[0].message.tool_calls or []] == ["get_weather"]
    stream = await _create(
        client,
        model=MODEL,
        messages=USER,
        tools=[WEATHER, TIME],
        parallel_tool_calls=False,
        stream=True,
    )
    indexes = {d.index async for c in stream for d in (c.choices[0].delta.tool_calls or [])}
    assert indexes == {0}


async def test_auto_tool_calls_streaming(client: openai.AsyncOpenAI, reply: Reply) -> None:
    reply.text = TWO_CALLS
    stream = await _create(
        client,
        model=MODEL,
        messages=USER,
        tools=[WEATHER, TIME],
        stream=True,
    )
    chunks = [c async for c in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "Checking.\n\n"
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            if d.id is not None:  # the first delta of a call: id, type and name
                assert d.type == "function" and d.function is not None and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.function is not None and d.function.name is None
            assert d.function is not None
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert (
        chunks[-1].choices[0].delta.content is None and not chunks[-1].choices[0].delta.tool_calls
    )


async def test_stream_raw_sse_shapes(http: httpx.AsyncClient, reply: Reply) -> None:
    reply.text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    body = {"messages": USER, "tools": [TIME], "stream": True}
    resp = await http.post("/v1/chat/completions", json=body)
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line[6:7] == "{"]
    deltas = [e["choices"][0]["delta"] for e in events]
    tool_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first, *rest = tool_deltas
    assert set(first) == {"index", "id", "type", "function"}
    assert first["function"] == {"name": "get_time", "arguments": ""}
    # Then the arguments, in as many pieces as tokens carried them.
    assert rest and all(set(d) == {"index", "function"} and d["index"] == 0 for d in rest)
    assert "".join(d["function"]["arguments"] for d in rest) == "{}"
    assert all("content" not in d for d in deltas[1:])  # no blank content sent
    assert resp.text.rstrip().endswith("data: [DONE]")


async def test_named_tool_choice(
    client: openai.AsyncOpenAI, reply: Reply, fake_engine: Any
) -> None:
    reply.text = '{"city": "Paris"}'  # what the schema (the function's parameters) allows
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = await _create(
        client,
        model=MODEL,
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice=choice,
    )
    so = fake_engine.added[0].sampling_params.structured_outputs
    assert json.loads(so.json) == WEATHER["function"]["parameters"]
    msg = resp.choices[0].message
    assert msg.content is None and resp.choices[0].finish_reason == "stop"  # OpenAI's reason
    (call,) = msg.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments == reply.text
    stream = await _create(
        client,
        model=MODEL,
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        stream=True,
    )
    deltas = [d async for c in stream for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
    assert "".join((d.function.arguments or "") for d in deltas if d.function) == reply.text
    assert sum(d.id is not None for d in deltas) == 1


async def test_required_tool_choice(
    client: openai.AsyncOpenAI, reply: Reply, fake_engine: Any
) -> None:
    reply.text = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    resp = await _create(
        client,
        model=MODEL,
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice="required",
    )
    schema = json.loads(fake_engine.added[0].sampling_params.structured_outputs.json)
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    assert resp.choices[0].finish_reason == "tool_calls"
    assert resp.choices[0].message.content is None
    calls = resp.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]
    stream = await _create(
        client,
        model=MODEL,
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice="required",
        stream=True,
    )
    chunks = [c async for c in stream]
    names = [
        d.function.name
        for c in chunks
        for d in (c.choices[0].delta.tool_calls or [])
        if d.id and d.function
    ]
    assert names == ["get_weather", "get_time"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_tool_choice_none_and_no_tools_send_no_schema(
    http: httpx.AsyncClient, reply: Reply, fake_engine: Any
) -> None:
    reply.text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    resp = await http.post(
        "/v1/chat/completions", json={"messages": USER, "tools": [TIME], "tool_choice": "none"}
    )
    # "none": the text is not parsed, and nothing constrains it.
    assert resp.json()["choices"][0]["message"] == {"role": "assistant", "content": reply.text}
    assert fake_engine.added[0].sampling_params.structured_outputs is None


async def test_template_receives_tools_and_tool_history(
    http: httpx.AsyncClient, tokenizer: Any, fake_engine: Any, reply: Reply
) -> None:
    reply.text = "It is sunny."
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
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"messages": messages, "tools": [WEATHER], "chat_template": TOOL_TEMPLATE}
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    prompt = tokenizer.decode(fake_engine.added[0].prompt_token_ids)
    params = json.dumps(WEATHER["function"]["parameters"])
    assert prompt.startswith(f"<|im_start|>system\nTOOLS: get_weather={params}<|im_end|>\n")
    # The arguments reach the template as an object (tojson of a dict, not of a string).
    assert '<|im_start|>assistant\nCALL call_1 get_weather {"city": "Paris"}<|im_end|>' in prompt
    assert "<|im_start|>tool\nRESULT call_1: sunny<|im_end|>" in prompt
    assert resp.json()["choices"][0]["message"]["content"] == "It is sunny."


async def test_exclude_tools_when_tool_choice_none(
    llm: AsyncLLM, tokenizer: Any, fake_engine: Any, reply: Reply
) -> None:
    reply.text = "ok"
    config = ToolCallingConfig(True, "hermes", exclude_tools_when_tool_choice_none=True)
    body = {"messages": USER, "tools": [WEATHER], "chat_template": TOOL_TEMPLATE}
    async with await _http(llm, config) as http:
        await http.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
        await http.post("/v1/chat/completions", json={**body, "tool_choice": "auto"})
    none_prompt, auto_prompt = (tokenizer.decode(r.prompt_token_ids) for r in fake_engine.added)
    assert "TOOLS:" not in none_prompt and "TOOLS: get_weather" in auto_prompt


BAD: list[tuple[dict[str, Any], str]] = [
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [WEATHER], "tool_choice": 7}, "tool_choice"),
    (
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
async def test_bad_tool_requests_are_400s(
    http: httpx.AsyncClient, fake_engine: Any, extra: dict[str, Any], param: str
) -> None:
    resp = await http.post("/v1/chat/completions", json={"messages": USER, **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert fake_engine.added == []
    assert (await http.get("/health")).status_code == 200  # and it keeps serving


async def test_auto_needs_the_flag(llm: AsyncLLM, fake_engine: Any) -> None:
    # vLLM's rule holds for a template that renders tools (the generic format is only
    # the default where the template ignores them: test_api_generic_tools.py).
    async with await _http(llm, ToolCallingConfig()) as http:
        body = {"messages": USER, "tools": [WEATHER], "chat_template": TOOL_TEMPLATE}
        resp = await http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == (
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
        # Named and required choices need no parser, as in vLLM.
        resp = await http.post(
            "/v1/chat/completions",
            json={
                "messages": USER,
                "tools": [WEATHER],
                "tool_choice": "required",
                "chat_template": TOOL_TEMPLATE,
            },
        )
        assert resp.status_code == 200, resp.text


def test_build_app_refuses_auto_parser_without_a_known_template(
    llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A template that renders tools in no format paged knows (one that ignores them
    # gets the generic format instead: test_api_generic_tools.py).
    monkeypatch.setattr(llm.tokenizer, "chat_template", TOOL_TEMPLATE)
    with pytest.raises(ValueError, match="name the parser"):
        build_app(llm, model_name=MODEL, tool_config=ToolCallingConfig(True, "auto"))
