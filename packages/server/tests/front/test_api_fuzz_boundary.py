"""HTTP-boundary robustness: what JSON allows but the engine cannot take is a 400 naming
the param, valid OpenAI requests are served, and the engine survives every bad request.

Found by fuzzing a live server (schemathesis) and by hand; each case here was a 500,
a wrongly rejected request or a malformed error before its fix.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from paged.server.async_llm import AsyncLLM
from paged.server.openai.api_server import build_app

MODEL = "tiny"
USER = [{"role": "user", "content": "hello"}]
JSON = {"content-type": "application/json"}


@pytest.fixture
async def http(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(llm, model_name=MODEL)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


async def _post_raw(http: httpx.AsyncClient, path: str, raw: str) -> httpx.Response:
    # Raw text: json.dumps would escape a lone surrogate the same way, but
    # this keeps the exact bytes under test visible.
    return await http.post(path, content=raw.encode(), headers=JSON)


def _assert_400(resp: httpx.Response, param: str | None, fragment: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert fragment in err["message"], err


HUGE = "1" + "0" * 30  # beyond int64 and uint64: msgspec cannot send it to the engine core


@pytest.mark.parametrize(
    ("path", "raw", "param", "fragment"),
    [
        ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt", "surrogate"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}',
            "messages[0].content[0].text",
            "surrogate",
        ),
        ("/v1/completions", '{"prompt": "x", "stop": ["\\ud83d"]}', "stop[0]", "surrogate"),
        (
            "/v1/completions",
            '{"prompt": "x", "logit_bias": {"\\ud800": 1}}',
            "logit_bias",
            "surrogate",
        ),
        ("/tokenize", '{"prompt": "\\udfff"}', "prompt", "surrogate"),
        ("/v1/completions", f'{{"prompt": "x", "seed": {HUGE}}}', "seed", "64-bit"),
        ("/v1/completions", f'{{"prompt": "x", "priority": {HUGE}}}', "priority", "64-bit"),
        ("/v1/completions", f'{{"prompt": "x", "top_k": -{HUGE}}}', "top_k", "64-bit"),
        ("/v1/completions", f'{{"prompt": [[1, {HUGE}]]}}', "prompt[0][1]", "64-bit"),
        ("/v1/chat/completions", f'{{"messages": [], "n": {HUGE}}}', "n", "64-bit"),
        ("/detokenize", f'{{"tokens": [{HUGE}]}}', "tokens[0]", "64-bit"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
            + "[" * 900
            + "]" * 900
            + "}}",
            "chat_template_kwargs",
            "nested",
        ),
        ("/v1/completions", "", None, "missing"),
    ],
)
async def test_unrepresentable_json_is_a_400(
    http: httpx.AsyncClient, fake_engine: Any, path: str, raw: str, param: str, fragment: str
) -> None:
    _assert_400(await _post_raw(http, path, raw), param, fragment)
    assert fake_engine.added == []
    assert (await http.get("/health")).status_code == 200


async def test_int64_bounds_are_accepted(http: httpx.AsyncClient, fake_engine: Any) -> None:
    raw = f'{{"prompt": "x", "max_tokens": 1, "seed": {2**63 - 1}, "priority": {-(2**63)}}}'
    resp = await _post_raw(http, "/v1/completions", raw)
    assert resp.status_code == 200, resp.text
    assert fake_engine.added[0].sampling_params.seed == 2**63 - 1


@pytest.mark.parametrize(
    "template",
    [
        "{{ range(10**9) | list }}",  # the jinja sandbox raises OverflowError
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",  # RecursionError
    ],
)
async def test_failing_request_chat_template_is_a_400(
    http: httpx.AsyncClient, fake_engine: Any, template: str
) -> None:
    body = {"messages": USER, "max_tokens": 1, "chat_template": template}
    resp = await http.post("/v1/chat/completions", json=body)
    _assert_400(resp, "messages", "chat template failed")
    assert fake_engine.added == []


@pytest.mark.parametrize(
    "extra",
    [
        {"metadata": {"project": "x"}, "store": False},
        {"service_tier": "auto", "user": "u-1"},
        {"reasoning_effort": "low", "verbosity": "low"},
        {"prompt_cache_key": "k", "safety_identifier": "s"},
        {"prediction": {"type": "content", "content": "hello"}},
        {"modalities": ["text"]},
    ],
)
async def test_openai_only_fields_are_accepted(
    http: httpx.AsyncClient, fake_engine: Any, extra: dict[str, Any]
) -> None:
    resp = await http.post(
        "/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **extra}
    )
    assert resp.status_code == 200, resp.text
    assert len(fake_engine.added) == 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata.k"),
    ],
)
async def test_unservable_openai_fields_are_rejected(
    http: httpx.AsyncClient, fake_engine: Any, extra: dict[str, Any], param: str
) -> None:
    resp = await http.post("/v1/chat/completions", json={"messages": USER, **extra})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert fake_engine.added == []


async def test_405_carries_allow_header(http: httpx.AsyncClient) -> None:
    resp = await http.get("/v1/completions")
    assert resp.status_code == 405
    assert resp.headers["allow"] == "POST"
    assert resp.json()["error"]["message"] == "Method Not Allowed"


# Fields whose served schema states bounds: a value at each bound is accepted and
# one just outside is a 400 naming the field, so the schema cannot drift from the checks.
BOUNDED = [
    ("temperature", 0.01),
    ("frequency_penalty", 0.01),
    ("presence_penalty", 0.01),
    ("n", 1),
    ("min_p", 0.01),
    ("top_logprobs", 1),
]


@pytest.mark.parametrize(("field", "step"), BOUNDED)
async def test_schema_bounds_match_the_checks(
    http: httpx.AsyncClient, field: str, step: float
) -> None:
    schema = (await http.get("/openapi.json")).json()
    prop = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"][field]
    base: dict[str, Any] = {"messages": USER, "max_tokens": 1}
    if field == "top_logprobs":
        base["logprobs"] = True
    # FastAPI may render integer bounds as floats (1.0); send them as the field's type.
    as_type = type(step)
    for bound, outside in ((as_type(prop["minimum"]), -step), (as_type(prop["maximum"]), step)):
        ok = await http.post("/v1/chat/completions", json={**base, field: bound})
        assert ok.status_code == 200, (field, bound, ok.text)
        bad = await http.post("/v1/chat/completions", json={**base, field: bound + outside})
        assert bad.status_code == 400, (field, bound + outside, bad.text)
        assert bad.json()["error"]["param"] == field


async def test_schema_requires_a_message_with_a_known_role(http: httpx.AsyncClient) -> None:
    schemas = (await http.get("/openapi.json")).json()["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    roles = schemas["ChatMessageParam"]["properties"]["role"]["enum"]
    for role in roles:
        msgs = [{"role": role, "content": "x"}, {"role": "user", "content": "hi"}]
        resp = await http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
        assert resp.status_code == 200, (role, resp.text)
    _assert_400(
        await http.post("/v1/chat/completions", json={"messages": [], "max_tokens": 1}),
        "messages",
        "at least one",
    )


def _events(text: str) -> list[dict[str, Any]]:
    lines = [ln[len("data: ") :] for ln in text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_puts_usage_on_every_token_chunk(
    http: httpx.AsyncClient, path: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 3, "stream": True}
    body |= {"messages": USER} if "chat" in path else {"prompt": "hello world"}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    resp = await http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    events = _events(resp.text)
    token_chunks = [e for e in events if e["choices"] and e["usage"] is not None]
    completions = [e["usage"]["completion_tokens"] for e in token_chunks]
    assert completions == [1, 2, 3]  # running totals, one token per chunk
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    # Without the option, token chunks carry no usage.
    body["stream_options"] = {"include_usage": True}
    plain = _events((await http.post(path, json=body)).text)
    assert all(e["usage"] is None for e in plain if e["choices"])


async def test_chat_echo_of_content_parts_is_their_text(http: httpx.AsyncClient) -> None:
    parts = [{"type": "text", "text": "Sure,"}, {"type": "text", "text": "here"}]
    body = {
        "messages": [*USER, {"role": "assistant", "content": parts}],
        "max_tokens": 2,
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["message"]["content"]
    # The parts joined as the template saw them, then the generated text; never a repr.
    assert content.startswith("Sure,\nhere") and "'type'" not in content
    stream = await http.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [e["choices"][0]["delta"].get("content") for e in _events(stream.text) if e["choices"]]
    assert "Sure,\nhere" in deltas


@pytest.mark.parametrize("top_p", [5e-324, 1e-40, 1e-45])
async def test_denormal_top_p_reaches_the_engine_as_a_float32_normal(
    http: httpx.AsyncClient, fake_engine: Any, top_p: float
) -> None:
    # Found by schemathesis: 5e-324 is in (0, 1] but 0.0 in float32, and the
    # runner's sampler then raised, killing the engine core (every later request 500).
    resp = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "top_p": top_p})
    assert resp.status_code == 200, resp.text
    sent = fake_engine.added[0].sampling_params.top_p
    assert sent > 0 and struct.unpack("f", struct.pack("f", sent))[0] > 0


@pytest.mark.parametrize("top_p", [0.0, -1e-300, float("nan"), 1.0000001])
async def test_out_of_range_top_p_is_still_rejected(
    http: httpx.AsyncClient, fake_engine: Any, top_p: float
) -> None:
    raw = json.dumps({"prompt": "x", "top_p": top_p})
    _assert_400(await _post_raw(http, "/v1/completions", raw), "top_p", "top_p")
    assert fake_engine.added == []


@pytest.mark.parametrize("raw", ['"\\ud800"', "1" + "0" * 30, "[1, 2]", "null", '"text"'])
async def test_a_body_that_is_not_an_object_is_a_plain_400(
    http: httpx.AsyncClient, fake_engine: Any, raw: str
) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        _assert_400(await _post_raw(http, path, raw), None, "valid dictionary or object")
    assert fake_engine.added == []
