"""EncodeOnlyRunner (EPD producer worker): the vision encoder alone, through a real
Scheduler in encode_only mode, with a recording EC connector; embeddings compared
bit for bit with the full Gemma3ForConditionalGeneration's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from packages.runner.tests.test_models_gemma3_mm import (
    BLOCK,
    MAX_LEN,
    TOKENS_PER_IMAGE,
    build_checkpoint,
    make_prompt,
    text,
)
from paged.kvcache import get_kv_cache_config
from paged.runner.config import CacheConfig, ModelConfig, SchedulerLimits
from paged.runner.encode_only import EncodeOnlyRunner, load_vision_encoder
from paged.runner.encoder_cache_buffer import PreallocatedEncoderCache
from paged.runner.loader import load_model
from paged.scheduler.boundary import EngineCoreRequest, FinishReason
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.scheduler import Scheduler


class RecordingProducer:
    """A producer-side connector that keeps a copy of every output it is handed."""

    is_producer = True
    is_consumer = False

    def __init__(self) -> None:
        self.saved: list[tuple[str, torch.Tensor]] = []
        self.cache: PreallocatedEncoderCache | None = None
        self.bound = 0

    def register_caches(self, encoder_cache: PreallocatedEncoderCache) -> None:
        self.cache = encoder_cache

    def bind_connector_metadata(self, connector_metadata: bytes) -> None:
        self.bound += 1

    def clear_connector_metadata(self) -> None:
        pass

    def start_load_caches(self, encoder_cache: PreallocatedEncoderCache, **kwargs: Any) -> None:
        raise AssertionError("a producer never loads")

    def save_caches(
        self, encoder_cache: PreallocatedEncoderCache, mm_hash: str, **kwargs: Any
    ) -> None:
        rows = encoder_cache.get(mm_hash)
        assert rows is not None
        self.saved.append((mm_hash, rows.clone()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return {h for h, _ in self.saved}, None

    def get_failed_loads(self) -> set[str]:
        return set()

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gemma3enc") / "ckpt")


@pytest.fixture(scope="module")
def model_config(checkpoint: Path) -> ModelConfig:
    return ModelConfig.from_pretrained(str(checkpoint), max_model_len=MAX_LEN)


def test_the_encoder_alone_loads_no_language_model_and_encodes_identically(
    model_config: ModelConfig,
) -> None:
    full: Any = load_model(model_config, "cpu")
    encoder: Any = load_vision_encoder(model_config, torch.device("cpu"))
    names = [n for n, _ in encoder.named_parameters()]
    assert names and all(
        n.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for n in names
    )
    full_params = sum(p.numel() for p in full.parameters())
    assert sum(p.numel() for p in encoder.parameters()) < full_params
    prompt = make_prompt([1, 2])
    items = [{"pixel_values": torch.from_numpy(p)} for p in prompt.pixels]
    with torch.no_grad():
        expected = full.embed_multimodal("image", items)
        got = encoder.embed_multimodal("image", items)
    assert len(got) == 2 and encoder.output_hidden_size == got[0].shape[1]
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_encode_only_steps_save_every_image_and_finish_without_tokens(
    model_config: ModelConfig,
) -> None:
    connector = RecordingProducer()
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64)
    cache_config = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    runner = EncodeOnlyRunner(model_config, cache_config, limits, "cpu", connector)
    runner.load_model()
    specs = runner.get_kv_cache_spec()
    kv = get_kv_cache_config(specs, runner.determine_available_memory(), max_model_len=MAX_LEN)
    runner.initialize_kv_cache(kv)
    assert connector.cache is runner.encoder_cache
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=64,
            disable_chunked_mm_input=True, max_num_encoder_input_tokens=2 * TOKENS_PER_IMAGE,
            encode_only=True,
        ),
        kv, BLOCK, enable_caching=False, max_tokens_per_mm_item=TOKENS_PER_IMAGE,
    )  # fmt: skip
    first = make_prompt([text(0, 5), 1, text(1, 3), 2, text(2, 4)])
    # Image 1 again (the consumer of this request may not have it) and a new one.
    second = make_prompt([text(3, 2), 1, 3])
    finished: dict[str, Any] = {}
    tokens: dict[str, list[int]] = {}
    # b comes after a finished: its img-1 is a hit in the producer's encoder cache.
    for rid, prompt in (("a", first), ("b", second)):
        scheduler.add_request(
            EngineCoreRequest(
                request_id=rid, prompt_token_ids=prompt.token_ids,
                sampling_params=SamplingParams(max_tokens=16), eos_token_id=1,
                arrival_time=0.0, mm_features=prompt.features,
            )
        )  # fmt: skip
        for _ in range(20):
            if not scheduler.has_requests():
                break
            so = scheduler.schedule()
            out = runner.execute_model(so)
            assert out.ec_connector_output is not None
            assert all(t == [] for t in out.sampled_token_ids)
            for per_client in scheduler.update_from_output(so, out).values():
                for o in per_client.outputs:
                    tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                    if o.finish_reason is not None:
                        finished[o.request_id] = o.finish_reason
    assert finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert tokens.get("a", []) == [] and tokens.get("b", []) == []
    full: Any = load_model(model_config, "cpu")
    pixels = {f.identifier: torch.from_numpy(p) for pr in (first, second)
              for f, p in zip(pr.features, pr.pixels, strict=True)}  # fmt: skip
    for mm_hash, rows in connector.saved:
        with torch.no_grad():
            (expected,) = full.embed_multimodal("image", [{"pixel_values": pixels[mm_hash]}])
        # Batched with another image here, alone there: equal up to float32 rounding.
        torch.testing.assert_close(rows, expected, atol=1e-6, rtol=1e-5, msg=mm_hash)
    # Three distinct images encoded once each; img-1 handed over again for request b.
    assert runner.num_encoded_items == 3
    assert sorted(h for h, _ in connector.saved) == ["img-1", "img-1", "img-2", "img-3"]
    assert runner.encoder_seconds > 0


def test_refuses_a_consumer_connector_and_unknown_architectures(model_config: ModelConfig) -> None:
    class Both(RecordingProducer):
        is_consumer = True

    with pytest.raises(ValueError, match="needs an ec_producer connector"):
        EncodeOnlyRunner(model_config, CacheConfig(), SchedulerLimits(), "cpu", Both())
    from dataclasses import replace

    llama = replace(model_config, architecture="LlamaForCausalLM")
    with pytest.raises(ValueError, match="has no encoder-only implementation"):
        load_vision_encoder(llama, torch.device("cpu"))
