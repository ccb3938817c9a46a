"""Media URL policy at the API: --allowed-media-domains and the bind-host address filter.

Real path: /v1/chat/completions with an image_url part -> frontend -> MediaConnector
-> fetch from an HTTP server on 127.0.0.1 (a thread), over the fake engine.
A refusal is a 400 with an OpenAI-style body naming the host; the engine never
sees the request and the local server never sees a connection.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, cast

import httpx
import pytest

from paged.multimodal.media_url_policy import MediaUrlPolicy
from paged.multimodal.processor_cache import ProcessorCacheConfig
from paged.server.async_llm import AsyncLLM
from paged.server.engine_args import EngineArgs, build_frontend_for
from paged.server.mm_frontend import build_mm_frontend, media_url_policy
from paged.server.mm_testing import png_data_url, random_png, save_tiny_gemma3_processor
from paged.server.openai.api_server import build_app

MODEL = "tiny-gemma3"
N = 4  # image tokens per image


class _Images(BaseHTTPRequestHandler):
    seen: ClassVar[list[str]] = []  # what the server was asked, for the tests to read

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        _Images.seen.append(self.path)
        body = random_png(3)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)


@pytest.fixture(scope="module")
def image_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gemma3-media-urls")
    save_tiny_gemma3_processor(path, image_size=32, mm_tokens_per_image=N)
    return path


@contextlib.asynccontextmanager
async def _api(
    proc_dir: Path, engine_cls: Any, policy: MediaUrlPolicy
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    frontend = build_mm_frontend(
        str(proc_dir),
        MODEL,
        cache_config=ProcessorCacheConfig("lru", 0.01),
        media_url_policy=policy,
    )
    tok = frontend.processor.hf_processor.tokenizer
    engine = engine_cls(vocab_size=len(tok))
    llm = AsyncLLM(engine, tok, max_model_len=256, vocab_size=len(tok), mm_frontend=frontend)
    try:
        app = build_app(llm, model_name=MODEL)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http, engine
    finally:
        llm.shutdown()


def _chat(url: str) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


@pytest.mark.parametrize(
    "bind_host,domains,expected",
    [
        # Exposed server, no list: the loopback address is refused by the address filter.
        ("0.0.0.0", None, r"media URL host '127.0.0.1' resolves to 127.0.0.1, a loopback address"),
        # vLLM's --allowed-media-domains, on a loopback-bound server as in vLLM.
        (
            "127.0.0.1",
            ["images.example.com"],
            r"allowed domains: ['images.example.com']. Input URL domain: 127.0.0.1",
        ),
    ],
)
async def test_refused_media_url_is_a_400_naming_the_host(
    proc_dir: Path,
    engine_cls: Any,
    image_url: str,
    bind_host: str,
    domains: list[str] | None,
    expected: str,
) -> None:
    policy = media_url_policy(domains, bind_host, {})
    async with _api(proc_dir, engine_cls, policy) as (http, engine):
        _Images.seen.clear()
        resp = await http.post("/v1/chat/completions", json=_chat(image_url))
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert expected in error["message"]
        assert error["type"] == "invalid_request_error" and error["param"] == "messages"
        assert _Images.seen == [] and engine.added == []
        ok = await http.post("/v1/chat/completions", json=_chat(png_data_url(1)))
        assert ok.status_code == 200 and len(engine.added) == 1


@pytest.mark.parametrize(
    "bind_host,domains",
    [("127.0.0.1", None), ("localhost", None), ("0.0.0.0", ["127.0.0.1"])],
)
async def test_loopback_bound_or_listed_host_is_fetched(
    proc_dir: Path, engine_cls: Any, image_url: str, bind_host: str, domains: list[str] | None
) -> None:
    policy = media_url_policy(domains, bind_host, {})
    async with _api(proc_dir, engine_cls, policy) as (http, engine):
        _Images.seen.clear()
        resp = await http.post("/v1/chat/completions", json=_chat(image_url))
        assert resp.status_code == 200, resp.text
        assert _Images.seen == ["/cat.png"] and len(engine.added) == 1


def test_build_frontend_for_takes_the_policy_from_the_bind_host(
    proc_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "7")
    hf_config = SimpleNamespace(vision_config=object(), mm_tokens_per_image=N)
    config = cast(
        Any,
        SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config, tokenizer=str(proc_dir))),
    )
    args = EngineArgs(model=MODEL, allowed_media_domains=["img.example.com"])
    exposed = build_frontend_for(args, config, bind_host="0.0.0.0")
    assert exposed is not None
    policy = exposed.media.url_policy
    assert policy.block_private and policy.allowed_domains == frozenset({"img.example.com"})
    assert exposed.media.limits.fetch_timeout_s == 7.0
    offline = build_frontend_for(args, config)  # the in-process LLM: no listener
    assert offline is not None and not offline.media.url_policy.block_private
    local = build_frontend_for(args, config, bind_host="127.0.0.1")
    assert local is not None and not local.media.url_policy.block_private
