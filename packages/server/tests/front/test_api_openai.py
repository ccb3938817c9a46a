"""The OpenAI-compatible app over a fake engine: the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import openai
import pytest

from paged.server.async_llm import AsyncLLM
from paged.server.metrics import PrometheusStatLogger
from paged.server.openai.api_server import build_app

from .asgi_clients import openai_client

MODEL = "tiny"


@pytest.fixture
def stats() -> PrometheusStatLogger:
    return PrometheusStatLogger(MODEL)


@pytest.fixture
async def http(llm: AsyncLLM, stats: PrometheusStatLogger) -> AsyncIterator[httpx.AsyncClient]:
    llm.stat_loggers.append(stats)
    app = build_app(llm, model_name=MODEL, stat_logger=stats)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


@pytest.fixture
def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai_client(http)


def _echo(tokenizer: Any, prompt_ids: list[int], n: int) -> str:
    ids = [prompt_ids[i % len(prompt_ids)] for i in range(n)]
    return str(tokenizer.decode(ids, skip_special_tokens=True))


async def test_chat_completion(
    client: openai.AsyncOpenAI, tokenizer: Any, fake_engine: Any
) -> None:
    resp = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello world"}], max_tokens=5
    )
    prompt_ids = fake_engine.added[0].prompt_token_ids
    assert tokenizer.decode(prompt_ids).startswith("<|im_start|>user\nhello world")
    assert resp.choices[0].message.content == _echo(tokenizer, prompt_ids, 5)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == 5
    assert resp.usage.total_tokens == len(prompt_ids) + 5
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 3
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"


async def test_chat_stream_with_usage(
    client: openai.AsyncOpenAI, tokenizer: Any, fake_engine: Any
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    prompt_ids = fake_engine.added[0].prompt_token_ids
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _echo(tokenizer, prompt_ids, 6)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


async def test_sse_ends_with_done(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}
    resp = await http.post("/v1/completions", json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = [line for line in resp.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e.removeprefix("data: "))


async def test_completions_n2_multi_prompt_logprobs(
    client: openai.AsyncOpenAI, tokenizer: Any
) -> None:
    resp = await client.completions.create(
        model=MODEL, prompt=["hello world", "the quick"], max_tokens=4, n=2, logprobs=2
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for c, prompt in zip(
        resp.choices, ["hello world", "hello world", "the quick", "the quick"], strict=True
    ):
        assert c.text == _echo(tokenizer, tokenizer.encode(prompt), 4)
        assert c.logprobs is not None and c.logprobs.tokens is not None
        assert "".join(c.logprobs.tokens) == c.text
        assert c.logprobs.top_logprobs is not None and len(c.logprobs.top_logprobs[0]) >= 2
        assert c.logprobs.text_offset == [
            sum(len(t) for t in c.logprobs.tokens[:k]) for k in range(len(c.logprobs.tokens))
        ]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(tokenizer.encode("hello world")) + len(
        tokenizer.encode("the quick")
    )
    assert resp.usage.completion_tokens == 16


async def test_chat_logprobs_and_stop(
    client: openai.AsyncOpenAI, engine_cls: Any, tokenizer: Any
) -> None:
    resp = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        stop=["user"],
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    # The echoed prompt starts "<|im_start|>user": the special token is skipped and
    # "user" is the stop string, so nothing is left.
    assert choice.message.content == ""
    assert choice.logprobs is not None and choice.logprobs.content is not None
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


async def test_streaming_n2_completion(client: openai.AsyncOpenAI, tokenizer: Any) -> None:
    stream = await client.completions.create(
        model=MODEL, prompt="hello world", max_tokens=5, n=2, stream=True
    )
    texts = {0: "", 1: ""}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    expected = _echo(tokenizer, tokenizer.encode("hello world"), 5)
    assert texts == {0: expected, 1: expected}


async def test_seed_and_extra_sampling_fields_reach_the_engine(
    client: openai.AsyncOpenAI, fake_engine: Any
) -> None:
    await client.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=3,
        seed=11,
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"5": 2},
        extra_body={
            "top_k": 7,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "min_tokens": 1,
            "ignore_eos": True,
            "stop_token_ids": [4],
        },
    )
    p = fake_engine.added[0].sampling_params
    assert (p.seed, p.temperature, p.top_p, p.top_k, p.min_p) == (11, 0.5, 0.9, 7, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (
        p.logit_bias == {5: 2.0} and p.min_tokens == 1 and p.ignore_eos and p.stop_token_ids == [4]
    )


async def test_max_tokens_defaults_to_what_fits(
    client: openai.AsyncOpenAI, fake_engine: Any
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    await stream.close()
    req = fake_engine.added[0]
    assert req.sampling_params.max_tokens == 128 - len(req.prompt_token_ids)


BAD_CHAT: list[tuple[dict[str, Any], int, str | None]] = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3.0}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 300}]}, 400, "prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}, 400, "logit_bias"),
    (
        {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 5},
        400,
        "presence_penalty",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {}}, 400, "stream_options"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({}, 400, "messages"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHAT)
async def test_bad_chat_requests(
    http: httpx.AsyncClient, fake_engine: Any, body: dict[str, Any], status: int, param: str | None
) -> None:
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]
    assert err["type"] == "invalid_request_error"
    assert fake_engine.added == []  # nothing reached the engine


async def test_malformed_json(http: httpx.AsyncClient) -> None:
    resp = await http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400
    assert "JSON" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 99999]}, "prompt"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
async def test_bad_completion_requests(
    http: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    resp = await http.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


async def test_openai_client_raises_typed_errors(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="other", prompt="x")


async def test_api_key(llm: AsyncLLM) -> None:
    app = build_app(llm, model_name=MODEL, api_key="sekret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        assert (await h.get("/v1/models")).status_code == 401
        wrong = await h.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        ok = await h.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL
        assert (await h.get("/health")).status_code == 200  # health needs no key


async def test_models_tokenize_detokenize_version(http: httpx.AsyncClient, tokenizer: Any) -> None:
    models = (await http.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 128
    tok = (await http.post("/tokenize", json={"prompt": "hello world"})).json()
    assert tok["tokens"] == tokenizer.encode("hello world") and tok["count"] == len(tok["tokens"])
    chat = (
        await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    ).json()
    assert tokenizer.decode(chat["tokens"]).endswith("<|im_start|>assistant\n")
    detok = (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json()
    assert detok == {"prompt": "hello world"}
    bad = await http.post("/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert (await http.get("/version")).json()["version"]
    schema = (await http.get("/openapi.json")).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize"} <= set(
        schema["paths"]
    )
    assert (await http.get("/nope")).json()["error"]["message"] == "Not Found"


async def test_metrics_endpoint(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    await client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    text = (await http.get("/metrics")).text
    assert 'paged:request_success_total{finished_reason="length",model_name="tiny"} 1.0' in text
    assert 'paged:generation_tokens_total{model_name="tiny"} 3.0' in text
    assert 'paged:http_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert "paged:e2e_request_latency_seconds_bucket" in text


async def test_engine_death_health_and_errors(http: httpx.AsyncClient, fake_engine: Any) -> None:
    assert (await http.get("/health")).status_code == 200
    fake_engine.kill()
    assert (await http.get("/health")).status_code == 503
    resp = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"


async def test_non_streaming_client_disconnect_aborts(
    tokenizer: Any, engine_cls: Any, stats: PrometheusStatLogger
) -> None:
    engine = engine_cls(step_delay=0.05)
    llm = AsyncLLM(engine, tokenizer, max_model_len=128)
    app = build_app(llm, model_name=MODEL)
    body = json.dumps({"prompt": "hello", "max_tokens": 100}).encode()
    sent: list[MutableMapping[str, Any]] = []
    calls = 0

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(0.2)  # a few tokens in, the client hangs up
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("c", 1),
        "headers": [(b"content-type", b"application/json")],
    }  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    assert len(engine.added) == 1 and engine.aborted == [engine.added[0].request_id]
    assert not engine.running and not llm.output_processor.has_unfinished_requests()
    llm.shutdown()


def _refuse_long(req: Any, n: int) -> Any:
    from paged.scheduler import FinishReason

    if len(req.prompt_token_ids) > 20:
        return FinishReason.LENGTH, "prompt has 30 tokens but the KV cache holds at most 20"
    return None


def _fail_after_two(req: Any, n: int) -> Any:
    from paged.scheduler import FinishReason

    return (FinishReason.ERROR, "3 NaN values in the logits") if n == 2 else None


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_refusal_is_a_400_and_failure_a_500(
    tokenizer: Any, engine_cls: Any, stream: bool
) -> None:
    engine = engine_cls(finish_hook=_refuse_long)
    llm = AsyncLLM(engine, tokenizer, max_model_len=128)
    app = build_app(llm, model_name=MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        long_prompt = {"prompt": "hello world " * 15, "max_tokens": 3, "stream": stream}
        resp = await h.post("/v1/completions", json=long_prompt)
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded" and "KV cache" in err["message"]
        short = await h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert short.status_code == 200  # the engine serves on
    llm.shutdown()
    engine = engine_cls(finish_hook=_fail_after_two)
    llm = AsyncLLM(engine, tokenizer, max_model_len=128)
    app = build_app(llm, model_name=MODEL)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": stream}
        resp = await h.post("/v1/chat/completions", json=chat)
        if stream:
            events = [e for e in resp.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert "NaN" in json.loads(events[-2].removeprefix("data: "))["error"]["message"]
        else:
            assert resp.status_code == 500 and "NaN" in resp.json()["error"]["message"]
    llm.shutdown()
