"""Constraints through the OpenAI API, over a real in-process engine on the tiny random model.

Every request field vLLM accepts for structured output is honoured (the
output satisfies it) or refused with a 400 naming the field; nothing is
silently ignored.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import jsonschema
import pydantic
import pytest

from paged.scheduler import EngineCoreOutputs, EngineCoreRequest
from paged.server.async_llm import AsyncLLM
from paged.server.engine.errors import EngineDeadError
from paged.server.openai.api_server import build_app

from ..asgi_clients import openai_client

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


class _AsyncInproc:
    """The LLM's in-process engine client behind AsyncLLM's async surface (one step per call)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @property
    def dead_error(self) -> EngineDeadError | None:
        return None

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.client.add_request(request)

    async def abort_requests_async(self, request_ids: Sequence[str]) -> None:
        self.client.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        while not self.client.has_work():
            await asyncio.sleep(0.002)
        return self.client.get_output()  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        pass


@pytest.fixture
async def http(tiny_llm: Any, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    llm = AsyncLLM(
        _AsyncInproc(tiny_llm.engine_client),
        tokenizer,
        max_model_len=tiny_llm.max_model_len,
        eos_token_ids=[tokenizer.eos_token_id],
        grammar_compiler=tiny_llm.grammar_compiler,
    )
    app = build_app(llm, model_name=MODEL)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client
    llm.shutdown()


def _chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, **extra}


async def _chat_text(http: httpx.AsyncClient, **extra: Any) -> str:
    resp = await http.post("/v1/chat/completions", json=_chat(**extra))
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return str(choice["message"]["content"])


@pytest.mark.parametrize("strict", [True, False, None])
async def test_chat_response_format_json_schema(http: httpx.AsyncClient, strict: Any) -> None:
    spec: dict[str, Any] = {"name": "person", "schema": SCHEMA}
    if strict is not None:
        spec["strict"] = strict
    for seed in range(3):
        text = await _chat_text(
            http, response_format={"type": "json_schema", "json_schema": spec}, seed=seed
        )
        jsonschema.validate(json.loads(text), SCHEMA)


async def test_chat_json_object_and_guided_fields(http: httpx.AsyncClient) -> None:
    text = await _chat_text(http, response_format={"type": "json_object"}, seed=1)
    assert isinstance(json.loads(text), dict)
    text = await _chat_text(http, guided_choice=["left", "right"], seed=2)
    assert text in ("left", "right")
    text = await _chat_text(http, guided_json=SCHEMA, seed=3)
    jsonschema.validate(json.loads(text), SCHEMA)
    text = await _chat_text(http, structured_outputs={"regex": "[0-9]{3}"}, seed=4)
    assert len(text) == 3 and text.isdigit()


def _compact_and_valid(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    outside_strings = re.sub(r'"(\\.|[^"\\])*"', "", text)
    return not any(c.isspace() for c in outside_strings)


async def test_completions_take_every_constraint_form(http: httpx.AsyncClient) -> None:
    forms: list[tuple[dict[str, Any], Any]] = [
        ({"guided_regex": "[ab]{4}"}, lambda t: len(t) == 4 and set(t) <= {"a", "b"}),
        ({"structured_outputs": {"choice": ["cat", "dog"]}}, lambda t: t in ("cat", "dog")),
        ({"guided_grammar": 'start: "x" "y"+'}, lambda t: t[0] == "x" and set(t[1:]) == {"y"}),
        ({"structured_outputs": {"grammar": 'root ::= "ok" | "no"'}}, lambda t: t in ("ok", "no")),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            _compact_and_valid,
        ),
    ]
    for extra, check in forms:
        body = {"prompt": "go", "max_tokens": 300, "seed": 5, **extra}
        resp = await http.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (extra, choice)
        assert check(choice["text"]), (extra, choice["text"])


async def test_streamed_json_schema_output_validates(http: httpx.AsyncClient) -> None:
    body = _chat(
        stream=True,
        seed=9,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )
    parts: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    parts.append(choice["delta"].get("content") or "")
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)


BAD = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    ({"guided_json": "{not json"}, "json"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "json"),
    ({"guided_regex": "a(b"}, "regex"),
    ({"guided_grammar": "start: undefined_rule"}, "grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {"type": "structural_tag"}}}, "structural_tag"),
    ({"guided_choice": []}, "guided_choice"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
async def test_bad_constraints_are_400_and_the_server_keeps_serving(
    http: httpx.AsyncClient, extra: dict[str, Any], param: str, endpoint: str
) -> None:
    base = _chat() if "chat" in endpoint else {"prompt": "go", "max_tokens": 4}
    resp = await http.post(endpoint, json={**base, **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    ok = await http.post("/v1/completions", json={"prompt": "go", "max_tokens": 2})
    assert ok.status_code == 200


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)


async def test_openai_client_parse_with_a_pydantic_model(http: httpx.AsyncClient) -> None:
    client = openai_client(http)
    completion = await client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "a person"}],
        response_format=Person,
        max_tokens=400,
        seed=3,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person) and 0 <= parsed.age <= 120


async def test_response_format_structural_tag(http: httpx.AsyncClient, tokenizer: Any) -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "integer"}}}
    schema.update(required=["n"], additionalProperties=False)
    lt = tokenizer.encode("<", add_special_tokens=False)[0]
    f = tokenizer.encode("f", add_special_tokens=False)[0]
    rf = {
        "type": "structural_tag",
        "structures": [{"begin": "<f=n>", "schema": schema, "end": "</f>"}],
        "triggers": ["<f"],
    }
    found = 0
    for seed in range(4):
        resp = await http.post(
            "/v1/chat/completions",
            json=_chat(
                response_format=rf, max_tokens=60, seed=seed, logit_bias={str(lt): 8, str(f): 8}
            ),
        )
        assert resp.status_code == 200, resp.text
        text = resp.json()["choices"][0]["message"]["content"]
        for m in re.finditer(r"<f(.*?)</f>", text, re.S):
            assert m.group(1).startswith("=n>"), text
            jsonschema.validate(json.loads(m.group(1)[3:]), schema)
            found += 1
    assert found >= 4
    bad = await http.post(
        "/v1/chat/completions", json=_chat(response_format={"type": "structural_tag"})
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structural_tag"


async def test_a_slow_compile_is_a_400_after_the_timeout_and_stalls_no_one(
    http: httpx.AsyncClient, tiny_llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    compiler = tiny_llm.grammar_compiler
    release = threading.Event()
    build = compiler._build

    def build_slowly_if_slow(key: Any) -> Any:
        if "slowgrammar" in key.text:
            release.wait(30)  # a compile that would never end on its own within the test
        return build(key)

    monkeypatch.setattr(compiler, "_build", build_slowly_if_slow)
    monkeypatch.setattr(compiler, "compile_timeout_s", 5.0)
    t = time.monotonic()
    slow = asyncio.create_task(
        http.post("/v1/completions", json={"prompt": "a", "max_tokens": 4,
                                           "guided_regex": "slowgrammar[0-9]+"})
    )  # fmt: skip
    await asyncio.sleep(0.1)
    # Meanwhile a constrained and an unconstrained request are served.
    fast = await http.post(
        "/v1/completions", json={"prompt": "b", "max_tokens": 4, "guided_regex": "[0-9]{2}"}
    )
    free = await http.post("/v1/completions", json={"prompt": "c", "max_tokens": 4})
    assert fast.status_code == free.status_code == 200
    assert not slow.done() and time.monotonic() - t < 5.0
    resp = await slow
    release.set()
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "regex" and "took longer than 5 s" in err["message"]
