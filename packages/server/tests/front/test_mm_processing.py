"""Gemma3 prompt processing against transformers' own Gemma3Processor, and the P0/P1 caches.

The hit-rate tests follow vLLM's processor-cache test: the same inputs with
and without the cache give identical engine inputs, and text and token
prompts with the same image share cache entries.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from paged.multimodal.processing import Gemma3MultiModalProcessor, PromptError, from_tensor_data
from paged.multimodal.processor_cache import ProcessorCacheConfig
from paged.scheduler import SamplingParams
from paged.server.input_processor import InputProcessor
from paged.server.mm_frontend import build_mm_frontend
from paged.server.mm_testing import random_png, save_tiny_gemma3_processor

N = 4  # image tokens per image of the tiny processor


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gemma3-proc")
    save_tiny_gemma3_processor(path, image_size=32, mm_tokens_per_image=N)
    return path


@pytest.fixture(scope="module")
def hf(proc_dir: Path) -> Any:
    from transformers import AutoProcessor

    auto: Any = AutoProcessor
    return auto.from_pretrained(str(proc_dir))


def image(seed: int) -> Image.Image:
    return Image.open(io.BytesIO(random_png(seed)))


@pytest.mark.parametrize(
    "text,num_images",
    [
        ("<bos>describe <start_of_image> please", 1),
        ("<bos><start_of_image><start_of_image> compare the two images", 2),
        ("<bos>what is in the picture?<start_of_image>", 1),
        ("<bos>hello world", 0),
    ],
)
def test_token_ids_and_pixels_match_transformers(hf: Any, text: str, num_images: int) -> None:
    images = [image(i) for i in range(num_images)]
    ours = Gemma3MultiModalProcessor(hf, "tiny").process(text, images, add_special_tokens=False)
    theirs = hf(text=text, images=images or None, return_tensors="np", add_special_tokens=False)
    assert ours.token_ids == theirs["input_ids"][0].tolist()
    if num_images:
        pixels = np.concatenate(
            [from_tensor_data(f.data["pixel_values"]) for f in ours.features if f.data]
        )
        np.testing.assert_array_equal(pixels, theirs["pixel_values"])
    # The embedding positions are exactly transformers' image-token mask.
    mask = np.zeros(len(ours.token_ids), dtype=bool)
    for f in ours.features:
        pos = f.mm_position
        assert ours.token_ids[pos.offset] == hf.tokenizer.convert_tokens_to_ids("<start_of_image>")
        assert pos.length == N + 2 and pos.is_embed == [False, *[True] * N, False]
        mask[pos.offset : pos.offset + pos.length] = pos.is_embed
    np.testing.assert_array_equal(mask, theirs["token_type_ids"][0] == 1)
    assert ours.num_image_tokens == N * num_images


def test_prompt_errors(hf: Any) -> None:
    p = Gemma3MultiModalProcessor(hf, "tiny")
    with pytest.raises(PromptError, match=r"1 image placeholder.*but 2 image"):
        p.process("<start_of_image> hi", [image(0), image(1)])
    with pytest.raises(PromptError, match="but no images were given"):
        p.process("<start_of_image> hi", [])
    soft = hf.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    with pytest.raises(PromptError, match="already hold expanded image tokens"):
        p.process([2, soft, 3], [image(0)])


def _input_processor(proc_dir: Path, cache: ProcessorCacheConfig) -> InputProcessor:
    frontend = build_mm_frontend(str(proc_dir), "tiny", cache_config=cache)
    tok = frontend.processor.hf_processor.tokenizer
    return InputProcessor(tok, max_model_len=512, vocab_size=len(tok), mm_frontend=frontend)


def _run(ip: InputProcessor, rid: str, prompt: Any) -> Any:
    request, _ = ip.process_inputs(rid, prompt, SamplingParams(max_tokens=4))
    return request


@pytest.mark.parametrize("cache_type", ["lru", "processor_only", "shm"])
def test_cached_and_uncached_give_the_same_engine_inputs(proc_dir: Path, cache_type: str) -> None:
    cached_cfg = ProcessorCacheConfig(cache_type, 0.01)
    cached = _input_processor(proc_dir, cached_cfg)
    uncached = _input_processor(proc_dir, ProcessorCacheConfig("lru", 0))
    receiver = cached_cfg.make_receiver()
    prompts = [
        {"prompt": "<bos>describe <start_of_image>", "multi_modal_data": {"image": image(0)}},
        {"prompt": "<bos>again <start_of_image>", "multi_modal_data": {"image": [image(0)]}},
        {
            "prompt": "<bos><start_of_image><start_of_image> compare",
            "multi_modal_data": {"image": [image(1), image(0)]},
        },
    ]
    try:
        for i, prompt in enumerate(prompts):
            a = _run(cached, f"c{i}", prompt)
            b = _run(uncached, f"u{i}", prompt)
            assert a.prompt_token_ids == b.prompt_token_ids
            assert receiver.fill(a.mm_features) == b.mm_features  # P1 restores what was omitted
        hits, queries = cached.mm_frontend.cache.hit_rate()  # type: ignore[union-attr]
        assert (hits, queries) == (2, 4)  # image 0 twice more; image 1 new
        sent = [_run(cached, "again", prompts[0]).mm_features[0].data]
        assert (sent[0] is None) == (cache_type in ("lru", "shm"))
    finally:
        cached.mm_frontend.close()  # type: ignore[union-attr]


def test_text_and_token_prompts_share_cache_entries(proc_dir: Path) -> None:
    ip = _input_processor(proc_dir, ProcessorCacheConfig("lru", 0.01))
    tok = ip.tokenizer
    text = "<bos>describe <start_of_image>"
    ids = tok.encode(text, add_special_tokens=False)
    a = _run(ip, "t", {"prompt": text, "multi_modal_data": {"image": image(3)}})
    b = _run(ip, "k", {"prompt_token_ids": ids, "multi_modal_data": {"image": image(3)}})
    assert a.mm_features[0].identifier == b.mm_features[0].identifier
    assert a.mm_features[0].data is not None and b.mm_features[0].data is None  # a hit
    assert ip.mm_frontend.cache.hit_rate() == (1, 2)  # type: ignore[union-attr]
    # A different picture is a different entry (and a different prefix-cache key).
    c = _run(ip, "d", {"prompt": text, "multi_modal_data": {"image": image(4)}})
    assert c.mm_features[0].identifier != a.mm_features[0].identifier


def test_input_processor_refuses_images_for_text_only_and_placeholders_alone(
    proc_dir: Path,
) -> None:
    ip = _input_processor(proc_dir, ProcessorCacheConfig("lru", 0.01))
    with pytest.raises(ValueError, match="no images were given"):
        _run(ip, "x", "<bos>look <start_of_image>")
    text_only = InputProcessor(ip.tokenizer, max_model_len=512)
    with pytest.raises(ValueError, match="text-only"):
        _run(text_only, "y", {"prompt": "hi", "multi_modal_data": {"image": image(0)}})
    with pytest.raises(ValueError, match="modality 'audio' is not supported"):
        _run(ip, "z", {"prompt": "hi", "multi_modal_data": {"audio": b""}})
    with pytest.raises(ValueError, match="must be a PIL image"):
        _run(ip, "w", {"prompt": "<start_of_image>", "multi_modal_data": {"image": "x.png"}})


def test_a_repeated_image_is_neither_processed_nor_sent_again(proc_dir: Path) -> None:
    from paged.server.engine.messages import AddRequestMessage
    from paged.server.engine.serial import (
        MsgpackDecoder,
        MsgpackEncoder,
        decode_add_request,
        encode_add_request,
    )

    ip = _input_processor(proc_dir, ProcessorCacheConfig("lru", 0.01))
    frontend = ip.mm_frontend
    assert frontend is not None
    text = "<bos>describe <start_of_image>"
    first = frontend.process("a", text, [image(8)], add_special_tokens=False)
    assert first.num_processed == 1
    frontend.commit("a", first.features)
    second = frontend.process("b", text, [image(8)], add_special_tokens=False)
    assert second.num_processed == 0 and second.features[0].data is None  # HF processor skipped
    frontend.discard("b")
    # Over ZMQ: the miss carries the pixels as their own frame, the hit carries none.
    encoder = MsgpackEncoder()
    prompt = {"prompt": text, "multi_modal_data": {"image": image(9)}}
    miss_request = _run(ip, "m", prompt)
    assert miss_request.mm_features[0].data is not None
    pixels = miss_request.mm_features[0].data["pixel_values"].data
    miss = encode_add_request(encoder, miss_request)
    hit = encode_add_request(encoder, _run(ip, "h", prompt))
    assert any(bytes(f) == pixels for f in miss[1:])
    assert len(hit) == 1 and pixels not in bytes(hit[0])
    decoded = decode_add_request(MsgpackDecoder(AddRequestMessage), miss)
    assert decoded.mm_features is not None and decoded.mm_features[0].data is not None
    assert decoded.mm_features[0].data["pixel_values"].data == pixels
