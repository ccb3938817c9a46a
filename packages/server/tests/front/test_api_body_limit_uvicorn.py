"""The body limit under a real uvicorn: a 413 arrives while the client is still sending.

The client declares (or streams) far more than the limit, sends only the first
part and then waits: the response must come without the rest ever being sent.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from paged.server.async_llm import AsyncLLM
from paged.server.openai.api_server import build_app

LIMIT = 1000


@pytest.fixture
def server_port(tokenizer: Any, fake_engine: Any) -> Iterator[int]:
    llm = AsyncLLM(fake_engine, tokenizer, max_model_len=128)
    app = build_app(llm, model_name="tiny", max_request_body_bytes=LIMIT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def _response_head(sock: socket.socket) -> bytes:
    sock.settimeout(10)  # the test fails, not hangs, if the server waits for the body
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_oversized_body_is_refused_before_it_is_sent(server_port: int, framing: str) -> None:
    part = b'{"prompt": "' + b"x" * (2 * LIMIT)
    if framing == "content-length":
        head = b"Content-Length: 100000000\r\n"
        body = part
    else:
        head = b"Transfer-Encoding: chunked\r\n"
        body = b"%x\r\n%s\r\n" % (len(part), part)  # one chunk over the limit, no last chunk
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + head
        + b"\r\n"
        + body
    )
    with socket.create_connection(("127.0.0.1", server_port)) as sock:
        sock.sendall(request)  # ...and never the rest of the body
        reply = _response_head(sock)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
