"""EngineCore with images: P1 restores what the frontend left out; bad items fail alone.

The tiny Gemma3 checkpoint (text + SigLIP) and its processor are built by the
test. Requests go through the real frontend pieces (`InputProcessor` with a
`MultiModalFrontend`) so the P0/P1 processor caches are exercised as served.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from PIL import Image

from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from paged.multimodal.processor_cache import ProcessorCacheConfig
from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits
from paged.scheduler.boundary import EngineCoreOutput, EngineCoreRequest
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.core import EngineCore
from paged.server.input_processor import InputProcessor
from paged.server.mm_frontend import MultiModalEngineOptions, build_mm_frontend
from paged.server.mm_testing import random_png, save_tiny_gemma3_model


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_gemma3_model(tmp_path_factory.mktemp("tiny-gemma3-core"))


def _config(path: Path) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig.from_pretrained(str(path), dtype="float32", max_model_len=128),
        cache_config=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 20),
        scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64),
    )


def _run(core: EngineCore) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for _ in range(500):
        if not core.has_work():
            return got
        for outputs in core.run_step().values():
            out: EngineCoreOutput
            for out in outputs.outputs:
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not go idle")


def _image(seed: int) -> Image.Image:
    return Image.open(io.BytesIO(random_png(seed)))


def test_mirror_restores_omitted_tensors_and_a_desync_fails_only_that_request(
    gemma3_dir: Path,
) -> None:
    cache = ProcessorCacheConfig("lru", 0.01)
    core = EngineCore(_config(gemma3_dir), mm_options=MultiModalEngineOptions(cache))
    frontend = build_mm_frontend(str(gemma3_dir), "tiny", cache_config=cache)
    tok = frontend.processor.hf_processor.tokenizer
    ip = InputProcessor(tok, max_model_len=128, vocab_size=len(tok), mm_frontend=frontend)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt": "<bos>describe <start_of_image>", "multi_modal_data": {"image": _image(0)}}
    first, _ = ip.process_inputs("a", prompt, params)  # type: ignore[arg-type]
    second, _ = ip.process_inputs("b", prompt, params)  # type: ignore[arg-type]
    assert first.mm_features and first.mm_features[0].data is not None
    assert second.mm_features and second.mm_features[0].data is None  # a P0 hit
    core.add_request(first)
    got = _run(core)
    core.add_request(second)
    got.update(_run(core))
    assert got["a"] == got["b"] and len(got["a"]) == 4
    # Sent without data, never seen by the engine: a clear error for that request only.
    unknown = msgspec.structs.replace(second.mm_features[0], identifier="f" * 64)
    stray = msgspec.structs.replace(second, request_id="c", mm_features=[unknown])
    with pytest.raises(ValueError, match="not in the engine's processor cache mirror"):
        core.add_request(stray)
    third, _ = ip.process_inputs("d", prompt, params)  # type: ignore[arg-type]
    core.add_request(third)
    assert _run(core)["d"] == got["a"]


def test_text_only_engine_refuses_multimodal_requests(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    core = EngineCore(_config(tmp_path))
    feature = MultiModalFeatureSpec(
        "image", "h", PlaceholderRange(1, 2), {"pixel_values": TensorData("<f4", [1], b"\0" * 4)}
    )
    request = EngineCoreRequest(
        request_id="x",
        prompt_token_ids=[1, 2, 3, 4],
        sampling_params=SamplingParams(max_tokens=2),
        eos_token_id=None,
        arrival_time=time.time(),
        mm_features=[feature],
    )
    with pytest.raises(ValueError, match="is text-only"):
        core.add_request(request)
    core.add_request(msgspec.structs.replace(request, request_id="y", mm_features=None))
    assert len(_run(core)["y"]) == 2
