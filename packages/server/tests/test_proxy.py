"""`paged proxy` against scripted upstreams (httpx.MockTransport): protocol, routing, errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from paged.server.cli import build_parser
from paged.server.proxy import (
    PREFILL_KV_TRANSFER_PARAMS,
    ProxyConfig,
    build_proxy_app,
    prefill_request,
)

P1, P2, D1, D2 = "http://p1", "http://p2", "http://d1", "http://d2"
PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "eng",
    "remote_request_id": "cmpl-1",
    "remote_block_ids": [3, 4],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}


class Upstreams:
    """Records every request; answers like paged serve instances would."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, Any] | None]] = []
        self.down: set[str] = set()
        self.fail: dict[str, httpx.Response] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"{request.url.scheme}://{request.url.host}"
        body = json.loads(request.content) if request.content else None
        self.seen.append((host, request.url.path, body))
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if host in self.fail:
            return self.fail[host]
        if request.url.path == "/health":
            return httpx.Response(200)
        assert body is not None
        if host.startswith("http://p"):
            return httpx.Response(
                200, json={"choices": [{"text": "x", "index": 0}], "kv_transfer_params": PARAMS}
            )
        if body.get("stream"):
            sse = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\n'
            return httpx.Response(200, content=sse + b"data: [DONE]\n\n")
        n = int(body.get("n", 1))
        return httpx.Response(
            200,
            json={"choices": [{"text": "decoded", "index": i} for i in range(n)], "from": host},
        )


@pytest.fixture
def upstreams() -> Upstreams:
    return Upstreams()


@pytest.fixture
def client(upstreams: Upstreams) -> Iterator[TestClient]:
    config = ProxyConfig((P1, P2), (D1, D2))
    with TestClient(build_proxy_app(config, httpx.MockTransport(upstreams))) as c:
        yield c


def _bodies(upstreams: Upstreams, prefix: str) -> list[dict[str, Any]]:
    return [b for h, p, b in upstreams.seen if h.startswith(prefix) and b is not None]


def test_prefill_request_is_vllms() -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 3,
    }
    req = prefill_request(body)
    assert req["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert req["kv_transfer_params"]["do_remote_decode"] is True
    assert req["max_tokens"] == 1 and req["max_completion_tokens"] == 1
    assert req["stream"] is False and "stream_options" not in req and req["n"] == 1
    assert body["max_tokens"] == 50  # the original is untouched


def test_decode_gets_the_original_request_with_the_prefills_params(
    client: TestClient, upstreams: Upstreams
) -> None:
    resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 7, "n": 2})
    assert resp.status_code == 200
    assert [c["index"] for c in resp.json()["choices"]] == [0, 1]
    (decode_body,) = _bodies(upstreams, "http://d")
    assert decode_body["kv_transfer_params"] == PARAMS
    assert decode_body["max_tokens"] == 7 and decode_body["n"] == 2


def test_round_robin_over_each_list(client: TestClient, upstreams: Upstreams) -> None:
    for _ in range(4):
        assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 200
    hosts = [h for h, p, _ in upstreams.seen if p == "/v1/chat/completions"]
    assert hosts == [P1, D1, P2, D2, P1, D1, P2, D2]


def test_streaming_relays_the_decoders_events(client: TestClient) -> None:
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 3


@pytest.mark.parametrize("side", [P1, D1])
def test_upstream_errors_pass_through(client: TestClient, upstreams: Upstreams, side: str) -> None:
    error = {"error": {"message": "bad temperature", "type": "invalid_request_error",
                       "param": "temperature", "code": None}}  # fmt: skip
    upstreams.fail[side] = httpx.Response(400, json=error)
    resp = client.post("/v1/completions", json={"prompt": "hi"})
    assert resp.status_code == 400 and resp.json() == error


def test_streaming_error_from_the_decoder_passes_through(
    client: TestClient, upstreams: Upstreams
) -> None:
    upstreams.fail[D1] = httpx.Response(500, json={"error": {"message": "engine died"}})
    resp = client.post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "engine died"


def test_unreachable_instance_is_a_502_in_openai_schema(
    client: TestClient, upstreams: Upstreams
) -> None:
    upstreams.down.add(P1)
    resp = client.post("/v1/completions", json={"prompt": "hi"})
    assert resp.status_code == 502
    err = resp.json()["error"]
    assert err["type"] == "server_error" and P1 in err["message"]
    assert _bodies(upstreams, "http://d") == []  # never sent on


def test_bad_json_is_a_400(client: TestClient) -> None:
    resp = client.post(
        "/v1/completions", content=b"{", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert client.post("/v1/completions", json=[1]).status_code == 400


def test_prefill_without_params_sends_the_request_plainly(
    client: TestClient, upstreams: Upstreams
) -> None:
    upstreams.fail[P1] = httpx.Response(200, json={"choices": [], "kv_transfer_params": None})
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    (decode_body,) = _bodies(upstreams, "http://d")
    assert "kv_transfer_params" not in decode_body


def test_health_reflects_every_upstream(client: TestClient, upstreams: Upstreams) -> None:
    ok = client.get("/health")
    assert ok.status_code == 200 and set(ok.json()["upstreams"].values()) == {"ok"}
    upstreams.down.add(D2)
    bad = client.get("/health")
    assert bad.status_code == 503
    assert bad.json()["upstreams"][D2].startswith("unreachable")


def test_config_and_cli_validation() -> None:
    with pytest.raises(ValueError, match="--decode"):
        ProxyConfig((P1,), ())
    with pytest.raises(ValueError, match="http://"):
        ProxyConfig(("p1:8000",), (D1,))
    ns = build_parser().parse_args(["proxy", "--prefill", P1, "--prefill", P2, "--decode", D1])
    assert ns.prefill == [P1, P2] and ns.decode == [D1]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["proxy", "--prefill", P1])


def test_client_disconnect_cancels_the_upstream_call() -> None:
    # The client goes away while the prefill computes: the proxy cancels that call
    # (closing its connection, which the instance answers by aborting) and never
    # sends the request on to a decoder.
    import asyncio

    calls: list[str] = []
    cancelled: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url.host))
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(str(request.url.host))
            raise
        return httpx.Response(200, json={})

    app = build_proxy_app(ProxyConfig((P1,), (D1,)), httpx.MockTransport(handler))
    body_read: list[bool] = []
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if not body_read:
            body_read.append(True)
            return {"type": "http.request", "body": b'{"prompt": "hi"}', "more_body": False}
        await started.wait()  # disconnect once the prefill is busy
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [
        (b"content-type", b"application/json")], "query_string": b"", "http_version": "1.1",
        "scheme": "http", "server": ("test", 80), "client": ("c", 1), "root_path": ""}  # fmt: skip

    async def main() -> None:
        async with app.router.lifespan_context(app):
            await asyncio.wait_for(app(scope, receive, send), timeout=10)  # type: ignore[arg-type]

    started = asyncio.Event()
    asyncio.run(main())
    assert calls == ["p1"] and cancelled == ["p1"]  # the decoder was never called
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
