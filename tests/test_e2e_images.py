"""End to end with images: openai client -> `paged serve` -> scheduler -> runner -> Gemma3.

A tiny random Gemma3ForConditionalGeneration (text + SigLIP) and its offline
processor are built by the test; the greedy answer to an image chat must be
the one transformers generates from the same checkpoint and the same prompt.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest

from paged.server.mm_testing import png_data_url, random_png, save_tiny_gemma3_model

if TYPE_CHECKING:
    from tests.conftest import LiveServer

pytestmark = pytest.mark.slow

MODEL = "tiny-gemma3"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gemma3-e2e")
    save_tiny_gemma3_model(path)
    (path / "media").mkdir()
    (path / "media" / "b.png").write_bytes(random_png(2))
    return path


@pytest.fixture(scope="module")
def server(launch_server: Callable[..., LiveServer], model_dir: Path) -> LiveServer:
    return launch_server(
        str(model_dir), "--served-model-name", MODEL, "--max-model-len", "256",
        "--kv-cache-memory", "64MiB", "--limit-mm-per-prompt", '{"image": 2}',
        "--allowed-local-media-path", str(model_dir / "media"),
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(api_key="x", base_url=f"{server.base_url}/v1", max_retries=0) as c:
        yield c


def _transformers_answer(model_dir: Path, messages: list[dict[str, Any]], seeds: list[int]) -> str:
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    auto: Any = AutoProcessor
    processor = auto.from_pretrained(str(model_dir))
    model: Any = Gemma3ForConditionalGeneration.from_pretrained(str(model_dir))
    model = model.to(torch.float32).eval()
    template_messages = [
        {
            "role": m["role"],
            "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]],
        }
        for m in messages
    ]
    text = processor.tokenizer.apply_chat_template(
        template_messages, tokenize=False, add_generation_prompt=True
    )
    images = [Image.open(io.BytesIO(random_png(s))) for s in seeds]
    inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    return str(processor.tokenizer.decode(new, skip_special_tokens=True))


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_chat_matches_transformers_and_repeats_identically(
    client: openai.OpenAI, model_dir: Path
) -> None:
    file_url = (model_dir / "media" / "b.png").as_uri()
    messages: Any = [
        {"role": "user", "content": [_text("describe"), _image(png_data_url(1))]},
        {"role": "assistant", "content": [_text("a picture")]},
        {"role": "user", "content": [_image(file_url), _text("and this?")]},
    ]
    expected = _transformers_answer(model_dir, messages, [1, 2])
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert first.choices[0].message.content == expected
    assert first.usage is not None and first.usage.completion_tokens == MAX_TOKENS
    # Again: processor-cache, encoder-cache and prefix-cache hits; the same answer.
    again = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert again.choices[0].message.content == expected
    assert again.usage is not None and again.usage.prompt_tokens == first.usage.prompt_tokens
    details = again.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) > 0
    # The same text with another picture: the image's blocks (and all after) miss.
    other = [messages[0] | {"content": [_text("describe"), _image(png_data_url(3))]}, *messages[1:]]
    resp = client.chat.completions.create(model=MODEL, messages=other, max_tokens=1)
    details = resp.usage.prompt_tokens_details if resp.usage else None
    assert details is not None and (details.cached_tokens or 0) < 16  # before the first image
    # Streaming gives the same text.
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_bad_image_requests_are_400_and_the_engine_keeps_serving(client: openai.OpenAI) -> None:
    too_many: Any = [{"role": "user", "content": [_image(png_data_url(i)) for i in range(3)]}]
    with pytest.raises(openai.BadRequestError, match="At most 2 image"):
        client.chat.completions.create(model=MODEL, messages=too_many, max_tokens=2)
    junk: Any = [{"role": "user", "content": [_image("data:image/png;base64,AAAA")]}]
    with pytest.raises(openai.BadRequestError, match="cannot decode image"):
        client.chat.completions.create(model=MODEL, messages=junk, max_tokens=2)
    ok: Any = [{"role": "user", "content": [_image(png_data_url(9))]}]
    resp = client.chat.completions.create(model=MODEL, messages=ok, max_tokens=2)
    assert resp.choices[0].finish_reason == "length"
