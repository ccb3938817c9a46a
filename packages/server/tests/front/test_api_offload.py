"""Large inputs never freeze the API: tokenization off the loop, bodies bounded.

`SlowTokenizer` makes encoding and template rendering of large inputs take
`SLOW_S` in a call that releases the GIL (as the Rust tokenizer does), so a
test can tell, without timing races, whether /health and small requests were
served while the large one was still being tokenized: they must finish
before it does. On the event loop, nothing else runs until it is done.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import pytest

from paged.server.async_llm import AsyncLLM
from paged.server.cli import build_parser
from paged.server.openai.api_server import build_app
from paged.server.openai.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES

SLOW_S = 1.5
BIG = 50_000  # characters: above the inline limit, so the work is offloaded
BIG_TEXT = "hello world " * (BIG // 10)


class SlowTokenizer:
    """The tiny tokenizer, with slow encodes and templates for large inputs."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.started = threading.Event()
        self.finished = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def _slow(self, size: int) -> None:
        if size > BIG:
            self.started.set()
            time.sleep(SLOW_S)  # releases the GIL, like the Rust tokenizer
            self.finished.set()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._slow(len(text))
        return list(self._inner.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        self._slow(sum(len(m["content"]) for m in conversation))
        return self._inner.apply_chat_template(conversation, **kwargs)


@pytest.fixture
def slow_tok(tokenizer: Any) -> SlowTokenizer:
    return SlowTokenizer(tokenizer)


@pytest.fixture
async def http(slow_tok: SlowTokenizer, fake_engine: Any) -> AsyncIterator[httpx.AsyncClient]:
    llm = AsyncLLM(fake_engine, slow_tok, max_model_len=1 << 20)
    transport = httpx.ASGITransport(app=build_app(llm, model_name="tiny"))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client
    llm.shutdown()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": BIG_TEXT, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": BIG_TEXT}], "max_tokens": 1},
        ),
        ("/tokenize", {"prompt": BIG_TEXT}),
        ("/tokenize", {"messages": [{"role": "user", "content": BIG_TEXT}]}),
    ],
)
async def test_a_huge_prompt_leaves_the_server_answering(
    http: httpx.AsyncClient, slow_tok: SlowTokenizer, path: str, body: dict[str, Any]
) -> None:
    big = asyncio.create_task(http.post(path, json=body, timeout=60))
    assert await asyncio.to_thread(slow_tok.started.wait, 30), "the big request never started"
    t0 = time.monotonic()
    health = await http.get("/health")
    small = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    elapsed = time.monotonic() - t0
    # Both answered while the big prompt was still being tokenized.
    assert not slow_tok.finished.is_set(), f"served only after the big prompt ({elapsed:.2f}s)"
    assert health.status_code == 200
    assert small.status_code == 200, small.text
    resp = await big
    assert resp.status_code == 200, resp.text


async def test_tokenize_and_detokenize_still_answer(http: httpx.AsyncClient) -> None:
    tok = await http.post("/tokenize", json={"prompt": BIG_TEXT, "return_token_strs": True})
    assert tok.status_code == 200
    data = tok.json()
    assert data["count"] == len(data["tokens"]) == len(data["token_strs"]) > 1000
    detok = await http.post("/detokenize", json={"tokens": data["tokens"]})
    assert detok.status_code == 200 and detok.json()["prompt"] == BIG_TEXT


# -- the body size limit ---------------------------------------------------------------


@pytest.fixture
async def limited(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(llm, model_name="tiny", max_request_body_bytes=1000)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


def _assert_413(resp: httpx.Response) -> None:
    assert resp.status_code == 413, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert "1000 bytes" in err["message"] and "--max-request-body-size" in err["message"]


async def test_body_over_the_limit_is_a_413(limited: httpx.AsyncClient, fake_engine: Any) -> None:
    ok = await limited.post(
        "/v1/completions", json={"prompt": "hello world " * 30, "max_tokens": 1}
    )
    assert ok.status_code == 200
    resp = await limited.post("/v1/completions", json={"prompt": "x" * 2000, "max_tokens": 1})
    _assert_413(resp)
    assert len(fake_engine.added) == 1  # only the small one


async def test_chunked_body_is_refused_without_reading_it_whole(
    limited: httpx.AsyncClient, fake_engine: Any
) -> None:
    pulled = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal pulled
        yield b'{"prompt": "'
        for _ in range(1000):  # 400 kB in all, never sent whole
            pulled += 1
            yield b"x" * 400
        yield b'"}'

    resp = await limited.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    _assert_413(resp)
    assert pulled <= 4  # stopped at the chunk that crossed 1000 bytes
    assert fake_engine.added == []


async def test_declared_length_over_the_limit_reads_no_body(llm: AsyncLLM) -> None:
    app = build_app(llm, model_name="tiny", max_request_body_bytes=1000)
    reads = 0
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"5000000")],
        "server": ("test", 80),
        "client": ("test", 1234),
        "scheme": "http",
        "root_path": "",
    }
    await app(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert reads == 0


def test_cli_flag() -> None:
    default = build_parser().parse_args(["serve"])
    assert default.max_request_body_size == DEFAULT_MAX_REQUEST_BODY_BYTES == 16 * 2**20
    ns = build_parser().parse_args(["serve", "--max-request-body-size", "1MiB"])
    assert ns.max_request_body_size == 2**20
