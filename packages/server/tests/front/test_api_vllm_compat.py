"""What vLLM's clients, dashboards and browsers rely on: ignored extra fields, the
case-insensitive Bearer scheme, CORS under vLLM's flags, OpenAI's null-content rule,
and metrics published under vLLM's `vllm:` names."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from paged.server.async_llm import AsyncLLM
from paged.server.cli import build_parser
from paged.server.metrics import PrometheusStatLogger
from paged.server.metrics_names import VLLM_NAMING, metrics_naming
from paged.server.openai.api_server import build_app
from paged.server.openai.cors import CorsConfig, cors_config_from, parse_json_list

MODEL = "tiny"
USER = [{"role": "user", "content": "hello"}]
IGNORED = "The following fields were present in the request but ignored"


async def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.fixture
async def http(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    async with await _client(build_app(llm, model_name=MODEL)) as client:
        yield client


# -- 1. unknown fields -------------------------------------------------------------------


async def test_unknown_fields_are_ignored_with_a_warning(
    http: httpx.AsyncClient, fake_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    body = {
        "messages": USER,
        "max_tokens": 2,
        "cache_prompt": True,  # llama.cpp's
        "guided_decoding_backend": "xgrammar",  # a vLLM field paged does not know
        "stream_options": None,
    }
    with caplog.at_level(logging.WARNING, logger="paged.server.openai.protocol"):
        resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert len(fake_engine.added) == 1
    warnings = [r.getMessage() for r in caplog.records if IGNORED in r.getMessage()]
    assert warnings == [f"{IGNORED}: {{'cache_prompt', 'guided_decoding_backend'}}"]


async def test_unknown_fields_are_ignored_in_completions_and_nested_objects(
    http: httpx.AsyncClient, fake_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    body = {
        "prompt": "hello",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "future_option": 1},
        "n_probs": 3,
    }
    with caplog.at_level(logging.WARNING, logger="paged.server.openai.protocol"):
        resp = await http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert '"usage"' in resp.text  # the known nested field still took effect
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "'n_probs'" in logged and "'future_option'" in logged


async def test_the_ignored_fields_warning_is_bounded(
    http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    extras = {f"x{i:03d}" + "y" * 500: i for i in range(100)}
    with caplog.at_level(logging.WARNING, logger="paged.server.openai.protocol"):
        resp = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **extras})
    assert resp.status_code == 200
    (message,) = [r.getMessage() for r in caplog.records if IGNORED in r.getMessage()]
    assert len(message) < 2000 and "84 more" in message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER, "cache_prompt": True, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "cache_prompt": True, "max_tokens": 1.5}, "max_tokens"),
        ({"messages": USER, "stream_options": {"include_usage": "yes", "x": 1}}, None),
    ],
)
async def test_known_fields_stay_strictly_typed(
    http: httpx.AsyncClient, fake_engine: Any, body: dict[str, Any], param: str | None
) -> None:
    resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == (param or "stream_options.include_usage")
    assert fake_engine.added == []


# -- 2. the Bearer scheme ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "status"),
    [
        ("Bearer sekret", 200),
        ("bearer sekret", 200),
        ("BEARER sekret", 200),
        ("bEaReR  sekret", 200),  # RFC 7235: one or more spaces
        ("Basic sekret", 401),
        ("bearersekret", 401),
        ("bearer sekret2", 401),
        ("sekret", 401),
    ],
)
async def test_bearer_scheme_is_case_insensitive(llm: AsyncLLM, header: str, status: int) -> None:
    async with await _client(build_app(llm, model_name=MODEL, api_key="sekret")) as h:
        resp = await h.get("/v1/models", headers={"Authorization": header})
    assert resp.status_code == status, resp.text


# -- 3. CORS --------------------------------------------------------------------------------

ORIGIN = "https://app.example"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


async def test_no_cors_headers_by_default(http: httpx.AsyncClient) -> None:
    simple = await http.get("/v1/models", headers={"Origin": ORIGIN})
    assert simple.status_code == 200
    assert "access-control-allow-origin" not in simple.headers
    pre = await http.options("/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in pre.headers


async def test_cors_as_configured(llm: AsyncLLM) -> None:
    cors = CorsConfig(allowed_origins=(ORIGIN,), allowed_methods=("GET", "POST"))
    app = build_app(llm, model_name=MODEL, api_key="sekret", cors=cors)
    async with await _client(app) as h:
        # A preflight carries no credentials: it is answered before the key check.
        pre = await h.options("/v1/chat/completions", headers=PREFLIGHT)
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == ORIGIN
        assert set(pre.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
        ok = await h.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        # A page can read the 401 too.
        denied = await h.get("/v1/models", headers={"Origin": ORIGIN})
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == ORIGIN
        other = await h.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        bad_pre = await h.options(
            "/v1/chat/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT"}
        )
        assert bad_pre.status_code == 400


def test_cors_flags_take_vllm_json_lists() -> None:
    ns = build_parser().parse_args(
        [
            "serve", "--allowed-origins", '["*"]', "--allowed-methods", '["GET", "POST"]',
            "--allowed-headers", '["Authorization"]', "--allow-credentials",
        ]
    )  # fmt: skip
    assert cors_config_from(ns) == CorsConfig(
        allowed_origins=("*",),
        allowed_methods=("GET", "POST"),
        allowed_headers=("Authorization",),
        allow_credentials=True,
    )
    default = cors_config_from(build_parser().parse_args(["serve"]))
    assert default == CorsConfig() and not default.enabled


def test_cors_options_without_origins_warn_that_cors_stays_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ns = build_parser().parse_args(["serve", "--allow-credentials"])
    with caplog.at_level(logging.WARNING, logger="paged.server.openai.cors"):
        config = cors_config_from(ns)
    assert not config.enabled
    assert "CORS stays off" in caplog.text


@pytest.mark.parametrize("value", ["*", '"*"', '{"a": 1}', "[1]", "[not json"])
def test_cors_flags_reject_what_is_not_a_json_list_of_strings(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--allowed-origins", value])
    assert exc.value.code == 2
    assert "--allowed-origins must be a JSON list of strings" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--allowed-headers"):
        parse_json_list(value, "--allowed-headers")


# -- 4. null content -----------------------------------------------------------------------

TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "system", "content": None}, *USER], "messages[0].content"),
        ([*USER, {"role": "assistant", "content": None}, *USER], "messages[1].content"),
        ([*USER, {"role": "tool", "content": None, "tool_call_id": "c1"}], "messages[1].content"),
    ],
)
async def test_null_content_is_a_400(
    http: httpx.AsyncClient, fake_engine: Any, messages: list[dict[str, Any]], param: str
) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        resp = await http.post(path, json={"messages": messages})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == param and "null" in err["message"]
    assert fake_engine.added == []


async def test_an_assistant_message_with_tool_calls_may_have_null_content(
    http: httpx.AsyncClient, fake_engine: Any
) -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    resp = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert len(fake_engine.added) == 1


# -- 5. vLLM metric names ------------------------------------------------------------------


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_under_vllm_names(llm: AsyncLLM) -> None:
    stats = PrometheusStatLogger(MODEL, naming=metrics_naming("vllm"))
    llm.stat_loggers.append(stats)
    async with await _client(build_app(llm, model_name=MODEL, stat_logger=stats)) as h:
        resp = await h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert resp.status_code == 200
        text = (await h.get("/metrics")).text
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
    }.items() <= types.items()
    assert not [n for n in types if n.startswith("paged:") and "http_requests" not in n]
    samples = _samples(text)
    lv = (("engine", "0"), ("model_name", MODEL))
    assert samples[("vllm:generation_tokens_total", lv)] == 3
    assert samples[("vllm:prompt_tokens_total", lv)] > 0
    assert samples[("vllm:kv_cache_usage_perc", lv)] == 0.25
    assert ("vllm:num_requests_waiting", lv) in samples
    success = "vllm:request_success_total"
    assert samples[(success, (*lv[:1], ("finished_reason", "length"), *lv[1:]))] == 1
    assert samples[(success, (*lv[:1], ("finished_reason", "stop"), *lv[1:]))] == 0
    assert samples[("vllm:e2e_request_latency_seconds_count", lv)] == 1
    ttft_le = [
        float(dict(labels)["le"])
        for (name, labels) in samples
        if name == "vllm:time_to_first_token_seconds_bucket"
    ]
    assert tuple(ttft_le) == (*VLLM_NAMING.ttft_buckets, float("inf"))


def test_metrics_prefix_flag() -> None:
    assert build_parser().parse_args(["serve"]).metrics_prefix == "paged"
    assert build_parser().parse_args(["serve", "--metrics-prefix", "vllm"]).metrics_prefix == (
        "vllm"
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-prefix", "sglang"])
    with pytest.raises(ValueError, match="metrics_prefix"):
        metrics_naming("sglang")
