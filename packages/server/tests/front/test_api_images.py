"""/v1/chat/completions with images, over a fake engine: the openai client, raw HTTP, 400s.

Every bad input is a 400 naming the problem, and the next good request is
served (the engine never saw the bad one).
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from paged.multimodal.media import MediaLimits
from paged.multimodal.processor_cache import ProcessorCacheConfig
from paged.scheduler import SamplingParams
from paged.server.async_llm import AsyncLLM
from paged.server.llm import LLM
from paged.server.mm_frontend import MultiModalFrontend, build_mm_frontend
from paged.server.mm_testing import png_data_url, random_png, save_tiny_gemma3_processor
from paged.server.openai.api_server import build_app

from .asgi_clients import asgi_client, openai_client

MODEL = "tiny-gemma3"
N = 4  # image tokens per image


class _Slow(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(2)
        body = random_png(7)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)


@pytest.fixture(scope="module")
def http_base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gemma3-api")
    save_tiny_gemma3_processor(path, image_size=32, mm_tokens_per_image=N)
    (path / "media").mkdir()
    (path / "media" / "a.png").write_bytes(random_png(0))
    return path


def _frontend(proc_dir: Path) -> MultiModalFrontend:
    return build_mm_frontend(
        str(proc_dir),
        MODEL,
        cache_config=ProcessorCacheConfig("lru", 0.01),
        limit_mm_per_prompt='{"image": 3}',
        allowed_local_media_path=str(proc_dir / "media"),
        media_limits=MediaLimits(fetch_timeout_s=0.5, max_image_pixels=200 * 200),
    )


@pytest.fixture
async def mm_llm(proc_dir: Path, engine_cls: Any) -> AsyncIterator[tuple[AsyncLLM, Any]]:
    frontend = _frontend(proc_dir)
    tok = frontend.processor.hf_processor.tokenizer
    engine = engine_cls(vocab_size=len(tok))
    llm = AsyncLLM(engine, tok, max_model_len=256, vocab_size=len(tok), mm_frontend=frontend)
    yield llm, engine
    llm.shutdown()


@pytest.fixture
async def client(mm_llm: tuple[AsyncLLM, Any]) -> AsyncIterator[openai.AsyncOpenAI]:
    app = build_app(mm_llm[0], model_name=MODEL)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield openai_client(http)


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


async def test_several_images_in_several_messages(
    client: openai.AsyncOpenAI, mm_llm: tuple[AsyncLLM, Any], proc_dir: Path, http_base: str
) -> None:
    _, engine = mm_llm
    messages: Any = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                _image(png_data_url(1)),
                _image((proc_dir / "media" / "a.png").as_uri()),
            ],
        },
        {"role": "assistant", "content": "they differ"},
        {"role": "user", "content": [_image(f"{http_base}/ok.png"), {"type": "text", "text": "?"}]},
    ]
    resp = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    request = engine.added[-1]
    feats = request.mm_features
    assert len(feats) == 3 and all(f.modality == "image" for f in feats)
    assert [f.mm_position.offset for f in feats] == sorted(f.mm_position.offset for f in feats)
    assert len({f.identifier for f in feats}) == 3
    soft = mm_llm[0].input_processor.mm_frontend.processor.image_token_id  # type: ignore[union-attr]
    assert request.prompt_token_ids.count(soft) == 3 * N
    # Usage counts the image tokens: prompt_tokens is the expanded prompt.
    assert resp.usage is not None and resp.usage.prompt_tokens == len(request.prompt_token_ids)
    assert resp.usage.completion_tokens == 3


async def test_streaming_image_chat_and_repeat_sends_no_tensor(
    client: openai.AsyncOpenAI, mm_llm: tuple[AsyncLLM, Any]
) -> None:
    _, engine = mm_llm
    messages: Any = [{"role": "user", "content": [_image(png_data_url(2))]}]
    for attempt in range(2):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        feature = engine.added[-1].mm_features[0]
        # First time the pixels travel; the repeat is a processor-cache hit (data=None).
        assert (feature.data is None) == (attempt == 1)


@pytest.mark.parametrize(
    "content,match",
    [
        ([_image(png_data_url(i)) for i in range(4)], "At most 3 image"),
        ([_image("data:image/png;base64," + base64.b64encode(b"junk").decode())], "cannot decode"),
        ([_image(png_data_url(1, (300, 300)))], "pixels, more than the limit"),
        ([_image("data:text/plain;base64,aGVsbG8=")], "unsupported media type 'text/plain'"),
        ([_image("SLOW")], "timed out"),
        ([{"type": "text", "text": "look <start_of_image>"}], "no images were given"),
        ([{"type": "input_audio", "input_audio": {}}], "'input_audio' is not supported"),
        ([_image("file:///etc/passwd")], "outside the allowed local media path"),
    ],
)
async def test_bad_image_inputs_are_400_and_the_engine_keeps_serving(
    client: openai.AsyncOpenAI,
    mm_llm: tuple[AsyncLLM, Any],
    http_base: str,
    content: list[dict[str, Any]],
    match: str,
) -> None:
    _, engine = mm_llm
    for part in content:
        if part.get("image_url", {}).get("url") == "SLOW":
            part["image_url"]["url"] = f"{http_base}/slow.png"
    before = len(engine.added)
    bad: Any = [{"role": "user", "content": content}]
    with pytest.raises(openai.BadRequestError, match=match) as info:
        await client.chat.completions.create(model=MODEL, messages=bad, max_tokens=2)
    assert info.value.status_code == 400
    assert len(engine.added) == before
    good: Any = [{"role": "user", "content": [_image(png_data_url(5)), _text("hi")]}]
    ok = await client.chat.completions.create(model=MODEL, messages=good, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


async def test_image_for_a_text_only_model_is_400(llm: AsyncLLM) -> None:
    app = build_app(llm, model_name="text-only")
    async with asgi_client(app) as http:
        body = {
            "model": "text-only",
            "messages": [{"role": "user", "content": [_image(png_data_url(1))]}],
        }
        resp = await http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert "text-only" in error["message"] and error["param"] == "messages"
        ok = await http.post(
            "/v1/chat/completions",
            json={"model": "text-only", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert ok.status_code == 200


def test_llm_generate_and_chat_with_multi_modal_data(proc_dir: Path, engine_cls: Any) -> None:
    from PIL import Image

    frontend = _frontend(proc_dir)
    tok = frontend.processor.hf_processor.tokenizer
    engine = engine_cls(vocab_size=len(tok))
    llm = LLM.from_engine_client(
        engine, tok, max_model_len=256, vocab_size=len(tok), mm_frontend=frontend
    )
    img = Image.open(proc_dir / "media" / "a.png")
    prompts: Any = [
        {"prompt": "<bos>describe <start_of_image>", "multi_modal_data": {"image": img}},
        {"prompt": "<bos>hello world"},
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    assert len(engine.added[0].mm_features) == 1 and not engine.added[1].mm_features
    chat = llm.chat(
        [{"role": "user", "content": [_image((proc_dir / "media" / "a.png").as_uri())]}],
        SamplingParams(max_tokens=2),
        use_tqdm=False,
    )
    assert chat[0].outputs[0].finish_reason == "length"
    # Same picture from a PIL image and from a file URL: one hash, a cache hit.
    assert engine.added[-1].mm_features[0].identifier == engine.added[0].mm_features[0].identifier
    assert engine.added[-1].mm_features[0].data is None
    with pytest.raises(ValueError, match="At most 3 image"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": [img] * 4}}, use_tqdm=False)


async def test_tokenize_with_images_is_a_clear_400(mm_llm: tuple[AsyncLLM, Any]) -> None:
    app = build_app(mm_llm[0], model_name=MODEL)
    async with asgi_client(app) as http:
        body = {"messages": [{"role": "user", "content": [_image(png_data_url(1))]}]}
        resp = await http.post("/tokenize", json=body)
        assert resp.status_code == 400 and "does not process images" in resp.text
