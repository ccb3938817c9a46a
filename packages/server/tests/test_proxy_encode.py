"""`paged proxy --encode`: the encoder stage (E + PD and E + P + D) against scripted upstreams."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from paged.server.cli import build_parser
from paged.server.proxy import ProxyConfig, build_proxy_app, encode_request, has_mm_input

E1, E2, P1, D1 = "http://e1", "http://e2", "http://p1", "http://d1"
KV_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [1]}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "describe"}, *parts]
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


class Upstreams:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, Any] | None]] = []
        self.fail: dict[str, httpx.Response] = {}
        # What encoder instances answer as ec_transfer_params (vLLM 0.33), by host.
        self.announce: dict[str, dict[str, Any]] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"{request.url.scheme}://{request.url.host}"
        body = json.loads(request.content) if request.content else None
        self.seen.append((host, request.url.path, body))
        if host in self.fail:
            return self.fail[host]
        if request.url.path == "/health":
            return httpx.Response(200)
        if host.startswith("http://e"):
            # An encoder-only instance: no tokens, finish_reason length.
            choice = {"index": 0, "message": {"role": "assistant", "content": ""},
                      "finish_reason": "length"}  # fmt: skip
            answer: dict[str, Any] = {"choices": [choice]}
            if host in self.announce:
                answer["ec_transfer_params"] = self.announce[host]
            return httpx.Response(200, json=answer)
        if host.startswith("http://p"):
            return httpx.Response(200, json={"choices": [], "kv_transfer_params": KV_PARAMS})
        if body is not None and body.get("stream"):
            return httpx.Response(200, content=b'data: {"x":1}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, json={"choices": [{"index": 0}], "from": host})

    def hosts(self, path: str = "/v1/chat/completions") -> list[str]:
        return [h for h, p, _ in self.seen if p == path]

    def bodies(self, prefix: str) -> list[dict[str, Any]]:
        return [b for h, _, b in self.seen if h.startswith(prefix) and b is not None]


@pytest.fixture
def upstreams() -> Upstreams:
    return Upstreams()


def proxy(upstreams: Upstreams, config: ProxyConfig) -> TestClient:
    return TestClient(build_proxy_app(config, httpx.MockTransport(upstreams)))


@pytest.fixture
def e_pd(upstreams: Upstreams) -> Iterator[TestClient]:
    with proxy(upstreams, ProxyConfig((), (D1,), encode_urls=(E1, E2))) as c:
        yield c


def test_encode_request_is_vllms() -> None:
    body = chat(IMAGE, max_tokens=50, max_completion_tokens=50, stream=True, n=2,
                stream_options={"include_usage": True}, kv_transfer_params={"x": 1})  # fmt: skip
    req = encode_request(body)
    assert req["max_tokens"] == 1 and req["max_completion_tokens"] == 1
    assert req["stream"] is False and req["n"] == 1
    assert "stream_options" not in req and "kv_transfer_params" not in req
    assert "ec_transfer_params" not in encode_request({**body, "ec_transfer_params": {}})
    assert req["messages"] == body["messages"]
    assert body["max_tokens"] == 50  # the original is untouched


def test_has_mm_input() -> None:
    assert has_mm_input(chat(IMAGE))
    assert has_mm_input(chat({"type": "input_audio", "input_audio": {}}))
    assert not has_mm_input(chat())
    assert not has_mm_input({"messages": [{"role": "user", "content": "plain text"}]})
    assert not has_mm_input({"prompt": "a completion"})


def test_e_pd_images_go_to_an_encoder_first_then_the_original_to_decode(
    e_pd: TestClient, upstreams: Upstreams
) -> None:
    body = chat(IMAGE, max_tokens=9)
    resp = e_pd.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200 and resp.json()["from"] == D1
    assert upstreams.hosts() == [E1, D1]
    (decode_body,) = upstreams.bodies("http://d")
    assert decode_body == body  # untouched: no kv params without a prefill stage
    (encode_body,) = upstreams.bodies("http://e")
    assert encode_body["max_tokens"] == 1
    e_pd.post("/v1/chat/completions", json=body)
    assert upstreams.hosts() == [E1, D1, E2, D1]  # round robin over the encoders


def announced(host: str, port: int) -> dict[str, Any]:
    entry = {"modality": "image", "item_indices": [0], "metadata": {}}
    return {"h-img": {**entry, "peer_host": host, "peer_port": port}}


def test_the_encoders_ec_transfer_params_reach_the_consumer(
    e_pd: TestClient, upstreams: Upstreams
) -> None:
    # vLLM 0.33: the encoder says where it holds each item; the consumer (here the
    # PD instance) gets that in its body, the client's own entries merged under it.
    upstreams.announce = {E1: announced("10.0.0.1", 5700), E2: announced("10.0.0.2", 5701)}
    client_params = {"h-img": {"peer_host": "stale", "peer_port": 1}, "other": {"x": 1}}
    body = chat(IMAGE, max_tokens=9, ec_transfer_params=client_params)
    assert e_pd.post("/v1/chat/completions", json=body).status_code == 200
    (encode_body,) = upstreams.bodies("http://e")
    assert "ec_transfer_params" not in encode_body  # the producer announces, is not told
    (decode_body,) = upstreams.bodies("http://d")
    assert decode_body["ec_transfer_params"] == {**announced("10.0.0.1", 5700), "other": {"x": 1}}
    assert decode_body["messages"] == body["messages"]
    assert e_pd.post("/v1/chat/completions", json=chat(IMAGE)).status_code == 200
    assert upstreams.bodies("http://d")[1]["ec_transfer_params"] == announced("10.0.0.2", 5701)


def test_an_encoder_that_announces_nothing_leaves_the_body_alone(
    e_pd: TestClient, upstreams: Upstreams
) -> None:
    upstreams.announce = {E1: "not an object"}  # type: ignore[dict-item]
    body = chat(IMAGE)
    assert e_pd.post("/v1/chat/completions", json=body).status_code == 200
    assert upstreams.bodies("http://d") == [body]


def test_e_p_d_gives_the_prefill_and_decode_the_encoders_params(upstreams: Upstreams) -> None:
    upstreams.announce = {E1: announced("10.0.0.1", 5700)}
    with proxy(upstreams, ProxyConfig((P1,), (D1,), encode_urls=(E1,))) as client:
        assert client.post("/v1/chat/completions", json=chat(IMAGE)).status_code == 200
    (prefill_body,) = upstreams.bodies("http://p")
    assert prefill_body["ec_transfer_params"] == announced("10.0.0.1", 5700)
    assert prefill_body["kv_transfer_params"]["do_remote_decode"] is True
    (decode_body,) = upstreams.bodies("http://d")
    assert decode_body["ec_transfer_params"] == announced("10.0.0.1", 5700)
    assert decode_body["kv_transfer_params"] == KV_PARAMS


def test_text_only_requests_skip_the_encoder(e_pd: TestClient, upstreams: Upstreams) -> None:
    assert e_pd.post("/v1/chat/completions", json=chat()).status_code == 200
    assert e_pd.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert [h for h, _, _ in upstreams.seen] == [D1, D1]


def test_e_p_d_runs_the_three_stages_in_order(upstreams: Upstreams) -> None:
    body = chat(IMAGE, stream=True)
    with (
        proxy(upstreams, ProxyConfig((P1,), (D1,), encode_urls=(E1,))) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    assert upstreams.hosts() == [E1, P1, D1]
    (prefill_body,) = upstreams.bodies("http://p")
    assert prefill_body["kv_transfer_params"]["do_remote_decode"] is True
    (decode_body,) = upstreams.bodies("http://d")
    assert decode_body["kv_transfer_params"] == KV_PARAMS and decode_body["stream"] is True


def test_an_encoder_error_passes_through_and_stops_the_request(
    e_pd: TestClient, upstreams: Upstreams
) -> None:
    error = {"error": {"message": "image too large", "type": "invalid_request_error",
                       "param": "messages", "code": None}}  # fmt: skip
    upstreams.fail[E1] = httpx.Response(400, json=error)
    resp = e_pd.post("/v1/chat/completions", json=chat(IMAGE))
    assert resp.status_code == 400 and resp.json() == error
    assert upstreams.hosts() == [E1]  # the decoder never saw it


def test_an_unreachable_encoder_is_a_502(upstreams: Upstreams) -> None:
    def transport(request: httpx.Request) -> httpx.Response:
        if request.url.host == "e1":
            raise httpx.ConnectError("refused", request=request)
        return upstreams(request)

    app = build_proxy_app(ProxyConfig((), (D1,), encode_urls=(E1,)), httpx.MockTransport(transport))
    with TestClient(app) as client:
        resp = client.post("/v1/chat/completions", json=chat(IMAGE))
    assert resp.status_code == 502
    assert "instance http://e1 is unreachable" in resp.json()["error"]["message"]


def test_health_includes_the_encoders(e_pd: TestClient, upstreams: Upstreams) -> None:
    assert e_pd.get("/health").status_code == 200
    upstreams.fail[E2] = httpx.Response(500)
    resp = e_pd.get("/health")
    assert resp.status_code == 503 and resp.json()["upstreams"][E2] == "status 500"


def test_cli_and_config() -> None:
    ns = build_parser().parse_args(["proxy", "--encode", E1, "--encode", E2, "--decode", D1])
    assert ns.encode == [E1, E2] and ns.prefill == [] and ns.decode == [D1]
    with pytest.raises(ValueError, match="--prefill: at least one prefill instance URL"):
        ProxyConfig((), (D1,))
    with pytest.raises(ValueError, match="must start with http"):
        ProxyConfig((), (D1,), encode_urls=("e1:8000",))
