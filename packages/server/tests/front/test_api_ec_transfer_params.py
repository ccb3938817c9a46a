"""vLLM 0.33's `ec_transfer_params` at the API: checked on the way in (400, never a 5xx),
handed to the engine as sent, and the engine's answer returned in the response."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from paged.server.async_llm import AsyncLLM
from paged.server.openai.api_server import build_app

MODEL = "tiny"
USER = [{"role": "user", "content": "hello"}]
PARAMS = {
    "h1": {"modality": "image", "item_indices": [0], "metadata": {},
           "peer_host": "10.0.0.1", "peer_port": 5700},
    "ec_items": [{"mm_hash": "h1", "transfer_id": "t"}],
}  # fmt: skip


@pytest.fixture
async def http(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(llm, model_name=MODEL)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        yield client


def bodies(params: object) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "ec_transfer_params": params}),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2, "ec_transfer_params": params}),
    ]


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        # Not an object: refused by the request model itself (pydantic's message).
        ("h1", "'ec_transfer_params'"),
        ([{"peer_host": "a", "peer_port": 1}], "'ec_transfer_params'"),
        ({"h1": {"peer_host": "a", "peer_port": 70000}}, "ec_transfer_params['h1'].peer_port"),
        ({"h1": {"peer_host": 5, "peer_port": 5700}}, "ec_transfer_params['h1'].peer_host"),
        ({"h1": {"peer_host": "a"}}, "ec_transfer_params['h1'].peer_port"),
    ],
)
async def test_bad_ec_transfer_params_are_a_400_naming_the_field(
    http: httpx.AsyncClient, fake_engine: Any, params: object, fragment: str
) -> None:
    for path, body in bodies(params):
        resp = await http.post(path, json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == "ec_transfer_params"
        assert fragment in error["message"]
    assert fake_engine.added == []


async def test_params_reach_the_engine_and_its_answer_the_response(
    http: httpx.AsyncClient, fake_engine: Any
) -> None:
    for path, body in bodies(PARAMS):
        resp = await http.post(path, json=body)
        assert resp.status_code == 200, resp.text
        # The fake engine answers the request's params back, as a producer answers its own.
        assert resp.json()["ec_transfer_params"] == PARAMS
    assert [r.ec_transfer_params for r in fake_engine.added] == [PARAMS, PARAMS]
    resp = await http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["ec_transfer_params"] is None
    assert fake_engine.added[-1].ec_transfer_params is None
