"""Request ids as vLLM 0.33: the response's `id` is the prefix plus the client's id
(X-Request-Id, else the body's `request_id`), the engine's id adds a random suffix,
so two requests in flight may share a client id and aborting one leaves the other."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import MutableMapping
from typing import Any

import httpx

from paged.server.async_llm import AsyncLLM
from paged.server.openai.api_server import build_app

from .asgi_clients import asgi_client

MODEL = "tiny"


def _client(app: Any) -> httpx.AsyncClient:
    return asgi_client(app)


async def test_response_id_is_the_prefix_and_the_clients_id(
    tokenizer: Any, fake_engine: Any
) -> None:
    llm = AsyncLLM(fake_engine, tokenizer, max_model_len=128)
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    async with _client(build_app(llm, model_name=MODEL)) as http:
        by_body = await http.post("/v1/chat/completions", json={**chat, "request_id": "b1"})
        by_header = await http.post(
            "/v1/chat/completions",
            json={**chat, "request_id": "b1"},
            headers={"X-Request-Id": "h1"},  # the header wins, as vLLM's _base_request_id
        )
        fresh = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        listed = await http.post(
            "/v1/completions", json={"prompt": ["hello", "world"], "max_tokens": 2}
        )
    assert by_body.json()["id"] == "chatcmpl-b1"
    assert by_header.json()["id"] == "chatcmpl-h1"
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", fresh.json()["id"])
    engine_ids = [r.request_id for r in fake_engine.added]
    assert re.fullmatch(r"chatcmpl-b1-[0-9a-f]{8}", engine_ids[0])
    assert re.fullmatch(r"chatcmpl-h1-[0-9a-f]{8}", engine_ids[1])
    # Several prompts: one engine request each, "{id}-{i}" before the suffix (vLLM).
    base = listed.json()["id"]
    assert [rid[: len(base) + 2] for rid in engine_ids[3:]] == [f"{base}-0", f"{base}-1"]
    llm.shutdown()


async def test_two_requests_share_an_id_and_one_disconnects(
    tokenizer: Any, engine_cls: Any
) -> None:
    engine = engine_cls(step_delay=0.02)
    llm = AsyncLLM(engine, tokenizer, max_model_len=128)
    app = build_app(llm, model_name=MODEL)
    headers = {"X-Request-Id": "shared"}
    body = json.dumps({"prompt": "hello", "max_tokens": 100}).encode()
    calls = 0

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(0.3)  # a few tokens in, this client hangs up
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        pass

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("c", 1),
        "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"shared")],
    }  # fmt: skip

    async def leaves() -> None:
        await asyncio.wait_for(app(scope, receive, send), timeout=10)

    async def stays() -> httpx.Response:
        await asyncio.sleep(0.05)  # the leaving one is in flight first
        async with _client(app) as http:
            payload = {"prompt": "hello world", "max_tokens": 30}
            return await http.post("/v1/completions", json=payload, headers=headers)

    _, resp = await asyncio.gather(leaves(), stays())
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["id"] == "cmpl-shared"
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 30
    gone, kept = sorted(engine.added, key=lambda r: -(r.sampling_params.max_tokens or 0))
    assert gone.request_id != kept.request_id
    assert all(re.fullmatch(r"cmpl-shared-[0-9a-f]{8}", r.request_id) for r in (gone, kept))
    assert engine.aborted == [gone.request_id]  # the one that left, and only it
    assert not llm.output_processor.has_unfinished_requests()
    llm.shutdown()
