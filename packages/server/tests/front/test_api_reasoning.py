"""--reasoning-parser through the HTTP API, over a scripted fake engine (openai client and SSE)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from paged.scheduler import EngineCoreRequest
from paged.server.async_llm import AsyncLLM
from paged.server.openai.api_server import build_app
from paged.server.openai.tools import ToolCallingConfig
from paged.server.structured_output import GrammarCompiler, load_ll_tokenizer

from .asgi_clients import asgi_client, openai_client

MODEL = "tiny"
USER = [{"role": "user", "content": "hello"}]
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


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
        fake_engine, tokenizer, max_model_len=4096, eos_token_ids=eos, grammar_compiler=compiler
    )
    yield engine
    engine.shutdown()


def _http(llm: AsyncLLM, parser: str | None = "deepseek_r1") -> httpx.AsyncClient:
    app = build_app(
        llm,
        model_name=MODEL,
        tool_config=ToolCallingConfig(True, "hermes"),
        reasoning_parser=parser,
    )
    return asgi_client(app)


@pytest.fixture
async def http(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    async with _http(llm) as client:
        yield client


async def _sse(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def _join(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


async def test_message_carries_reasoning_and_answer(http: httpx.AsyncClient, reply: Reply) -> None:
    reply.text = "<think>Two plus two.</think>It is 4."
    client = openai_client(http)
    resp = await client.chat.completions.create(model=MODEL, messages=USER)  # type: ignore[arg-type]
    message = resp.choices[0].message
    assert message.content == "It is 4."
    assert message.model_dump()["reasoning"] == "Two plus two."
    # vLLM 0.33 sends `reasoning` only (no more `reasoning_content`).
    raw = (await http.post("/v1/chat/completions", json={"messages": USER})).json()
    assert set(raw["choices"][0]["message"]) == {"role", "content", "reasoning"}


async def test_streamed_reasoning_deltas_then_content(
    http: httpx.AsyncClient, reply: Reply
) -> None:
    reply.text = "<think>Two plus two.</think>It is 4."
    chunks = await _sse(http, {"messages": USER, "stream": True})
    assert _join(chunks, "reasoning") == "Two plus two."
    assert _join(chunks, "content") == "It is 4."
    kinds = [k for c in chunks for k in c["choices"][0]["delta"] if k in ("reasoning", "content")]
    first_content = kinds.index("content", 1)  # after the role chunk's empty content
    assert "reasoning" not in kinds[first_content:]  # all thinking comes first
    text = json.dumps(chunks)
    assert "think>" not in text and "</th" not in text


async def test_no_end_tag_is_all_reasoning(http: httpx.AsyncClient, reply: Reply) -> None:
    reply.text = "<think>cut off"
    body = {"messages": USER}
    message = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "reasoning": "cut off"}


async def test_include_reasoning_false_hides_the_thinking(
    http: httpx.AsyncClient, reply: Reply
) -> None:
    reply.text = "<think>secret</think>The answer."
    body = {"messages": USER, "include_reasoning": False}
    message = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "The answer."}
    chunks = await _sse(http, {**body, "stream": True})
    assert _join(chunks, "reasoning") == "" and _join(chunks, "content") == "The answer."
    assert "secret" not in json.dumps(chunks)


async def test_include_reasoning_false_constrains_from_the_start(
    http: httpx.AsyncClient, reply: Reply, fake_engine: Any
) -> None:
    """The grammar holds from the first token (vLLM's reasoning_ended=True), so the
    whole output is the answer (the scripted engine writes what the grammar allows)."""
    reply.text = "yes"
    body = {
        "messages": USER,
        "include_reasoning": False,
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    message = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "yes"}
    chunks = await _sse(http, {**body, "stream": True})
    assert _join(chunks, "reasoning") == "" and _join(chunks, "content") == "yes"
    so = [r.sampling_params.structured_outputs for r in fake_engine.added]
    assert [s.reasoning_ended for s in so] == [True, True]
    # With the thinking shown, the engine decides from the prompt's tags (vLLM: None).
    await http.post("/v1/chat/completions", json={**body, "include_reasoning": True})
    assert fake_engine.added[-1].sampling_params.structured_outputs.reasoning_ended is None


async def test_the_prompts_last_tag_decides_where_the_split_starts(
    llm: AsyncLLM, reply: Reply
) -> None:
    """A prompt that closed the thinking: all answer; one that opened it: thinking first,
    even for the generic parser (as the engine's grammar gate reads the same prompt)."""
    closed = [*USER, {"role": "assistant", "content": "<think>Easy.</think>"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    reply.text = "Yes."
    async with _http(llm, "deepseek_r1") as http:
        body = {"messages": closed, **cont}
        resp = (await http.post("/v1/chat/completions", json=body)).json()
        assert resp["choices"][0]["message"] == {"role": "assistant", "content": "Yes."}
        chunks = await _sse(http, {**body, "stream": True})
        assert _join(chunks, "content") == "Yes." and _join(chunks, "reasoning") == ""
    opened = [*USER, {"role": "assistant", "content": "<think>"}]
    reply.text = "hmm</think>Yes."
    async with _http(llm, "think") as http:
        body = {"messages": opened, **cont}
        resp = (await http.post("/v1/chat/completions", json=body)).json()
        message = resp["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("hmm", "Yes.")


async def test_tool_calls_are_read_from_the_answer_only(
    http: httpx.AsyncClient, reply: Reply
) -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    reply.text = f"<think>maybe {call}</think>No call needed."
    body = {"messages": USER, "tools": [WEATHER]}
    choice = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == "No call needed."
    reply.text = f"<think>I will call it.</think>{call}"
    choice = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] == "I will call it."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    chunks = await _sse(http, {**body, "stream": True})
    assert _join(chunks, "reasoning") == "I will call it."
    calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert calls and calls[0]["function"]["name"] == "get_weather"


async def test_qwen3_enable_thinking_false(llm: AsyncLLM, reply: Reply, fake_engine: Any) -> None:
    reply.text = "plain answer"
    body = {
        "messages": USER,
        "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_object"},
    }
    async with _http(llm, "qwen3") as http:
        resp = (await http.post("/v1/chat/completions", json=body)).json()
        assert resp["choices"][0]["message"]["content"] == "plain answer"
        assert "reasoning" not in resp["choices"][0]["message"]
        so = fake_engine.added[-1].sampling_params.structured_outputs
        assert so.reasoning_ended is True
        # Thinking on (qwen3's default): no start tag needed, all of it is thinking.
        body["chat_template_kwargs"] = {}
        resp = (await http.post("/v1/chat/completions", json=body)).json()
        assert resp["choices"][0]["message"]["reasoning"] == "plain answer"


async def test_without_a_parser_the_tags_stay_in_content(llm: AsyncLLM, reply: Reply) -> None:
    reply.text = "<think>x</think>y"
    async with _http(llm, None) as http:
        message = (await http.post("/v1/chat/completions", json={"messages": USER})).json()
    assert message["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y"}


async def test_reasoning_content_of_a_past_turn_reaches_the_template(
    http: httpx.AsyncClient, tokenizer: Any, fake_engine: Any
) -> None:
    tokenizer_template = tokenizer.chat_template
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content or '' }}|"
        "{{ m.reasoning or '' }}|{{ m.content }}\n{% endfor %}"
    )
    messages = [
        *USER,
        {"role": "assistant", "content": "A", "reasoning_content": "old thought"},
        {"role": "user", "content": "next"},
    ]
    body = {"messages": messages, "chat_template": template, "max_tokens": 1}
    assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    prompt = tokenizer.decode(fake_engine.added[-1].prompt_token_ids)
    assert "assistant:old thought|old thought|A" in prompt
    assert tokenizer.chat_template == tokenizer_template
    bad = [*USER, {"role": "assistant", "content": "A", "reasoning": 3}]
    resp = await http.post("/v1/chat/completions", json={"messages": bad})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages[1].reasoning"
