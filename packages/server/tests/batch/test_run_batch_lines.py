"""run_batch_lines: per-line errors, input order, the in-flight bound (no engine)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel

from paged.server.batch.endpoints import BatchEndpoint
from paged.server.batch.runner import run_batch_lines
from paged.server.errors import InvalidRequestError


class EchoRequest(BaseModel):
    text: str
    delay: float = 0.0
    stream: bool = False


class EchoResponse(BaseModel):
    echoed: str


class Recorder:
    def __init__(self) -> None:
        self.running = 0
        self.peak = 0

    async def handle(self, body: Any) -> BaseModel:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(body.delay)
            if body.text == "refuse":
                raise InvalidRequestError("text", "refused by the handler")
            if body.text == "crash":
                raise RuntimeError("engine failed")
            return EchoResponse(echoed=body.text)
        finally:
            self.running -= 1


def _line(custom_id: str, body: dict[str, Any], url: str = "/v1/echo", **extra: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def _run(lines: list[str], max_inflight: int = 8) -> tuple[list[dict[str, Any]], Recorder]:
    rec = Recorder()
    endpoints = {"/v1/echo": BatchEndpoint("/v1/echo", EchoRequest, rec.handle)}
    out: list[str] = []
    count = asyncio.run(run_batch_lines(lines, endpoints, out.append, max_inflight=max_inflight))
    assert count == len(out)
    return [json.loads(x) for x in out], rec


def test_outputs_follow_input_order_whatever_finishes_first() -> None:
    lines = [_line(f"req-{i}", {"text": str(i), "delay": 0.02 * (5 - i)}) for i in range(6)]
    outs, rec = _run(lines)
    assert [o["custom_id"] for o in outs] == [f"req-{i}" for i in range(6)]
    assert [o["response"]["body"]["echoed"] for o in outs] == [str(i) for i in range(6)]
    assert rec.peak > 1  # they did run concurrently
    first = outs[0]
    assert set(first) == {"id", "custom_id", "response", "error"} and first["error"] is None
    assert first["id"].startswith("vllm-")
    assert first["response"]["status_code"] == 200
    assert first["response"]["request_id"].startswith("vllm-batch-")


def test_bad_lines_get_error_lines_and_the_file_goes_on() -> None:
    lines = [
        _line("ok-1", {"text": "a"}),
        "{not json",
        json.dumps({"custom_id": "no-url", "method": "POST", "body": {}}),
        _line("bad-url", {"text": "a"}, url="/v1/nope"),
        _line("bad-body", {"text": 5}),
        _line("stream", {"text": "a", "stream": True}),
        _line("refused", {"text": "refuse"}),
        _line("crashed", {"text": "crash"}),
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/echo", "body": {}}),
        "",
        _line("ok-2", {"text": "b"}),
    ]
    outs, _ = _run(lines)
    by_id = [(o["custom_id"], o["response"]["status_code"]) for o in outs]
    assert by_id == [
        ("ok-1", 200),
        (None, 400),
        ("no-url", 400),
        ("bad-url", 400),
        ("bad-body", 400),
        ("stream", 400),
        ("refused", 400),
        ("crashed", 500),
        ("get", 400),
        ("ok-2", 200),
    ]
    errors = [o["error"] for o in outs]
    assert errors[0] is None and errors[-1] is None
    assert all(o["response"]["body"] is None for o in outs[1:-1])
    assert "line 2: not valid JSON" in errors[1]
    assert "url: Field required" in errors[2]
    assert errors[3] == "URL /v1/nope is not a supported endpoint. Supported endpoints: /v1/echo."
    assert errors[4]["error"]["type"] == "invalid_request_error"
    assert "text" in errors[4]["error"]["message"]
    assert errors[5] == "Request must not be sent in stream mode"
    assert errors[6]["error"] == {
        "message": "refused by the handler",
        "type": "invalid_request_error",
        "param": "text",
        "code": None,
    }
    assert errors[7]["error"]["type"] == "server_error"
    assert "POST" in errors[8]


def test_max_inflight_bounds_concurrency() -> None:
    lines = [_line(f"r{i}", {"text": "x", "delay": 0.01}) for i in range(10)]
    outs, rec = _run(lines, max_inflight=3)
    assert len(outs) == 10 and rec.peak == 3
    with pytest.raises(ValueError, match="max_inflight"):
        _run(lines, max_inflight=0)
