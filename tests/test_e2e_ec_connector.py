"""Encoder-cache transfer through the real engine: ECExampleConnector, producer -> consumer.

The tiny random Gemma3 of the multimodal tests answers one two-image chat
three ways: colocated (no connector), on a producer (`ec_producer`: saves
each encoder output as safetensors under the shared directory) and on a
second, fresh consumer engine (`ec_consumer` over the same directory). The
consumer must give the same greedy tokens and the same logprobs as the
colocated run while running the vision encoder zero times. Then one file is
corrupted and one removed: a third engine recomputes those two items (same
output) and loads nothing wrong.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch

from paged.connectors.ec.example import ECExampleConnector
from paged.runner.ec_connector import ECConnectorWorkerFactory
from paged.runner.encoder_runner import EncoderRunner
from paged.scheduler.sampling_params import SamplingParams
from paged.server.ec_transfer import ECConnectorBuilder
from paged.server.llm import LLM
from paged.server.mm_testing import png_data_url, save_tiny_gemma3_model

pytestmark = pytest.mark.slow

# mypy proves the server's builder satisfies the runner's factory Protocol.
_FACTORY_CHECK: type[ECConnectorWorkerFactory] = ECConnectorBuilder

MAX_TOKENS = 6
MESSAGES: list[dict[str, Any]] = [
    {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(11)}},
            {"type": "text", "text": "compare the two images"},
            {"type": "image_url", "image_url": {"url": png_data_url(12)}},
        ],
    }
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A random projector: with transformers' zero init every image embedding is 0,
    # and a consumer that loaded garbage-free zeros would pass for the wrong reason.
    return save_tiny_gemma3_model(tmp_path_factory.mktemp("tiny-gemma3-ec"), random_projector=True)


def _ec_config(role: str, storage: Path) -> dict[str, Any]:
    return {
        "ec_connector": "ECExampleConnector",
        "ec_role": role,
        "ec_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def _engine(model_dir: Path, **options: Any) -> LLM:
    return LLM(
        str(model_dir),
        device="cpu",
        max_model_len=256,
        kv_cache_memory_bytes=16 << 20,
        limit_mm_per_prompt='{"image": 2}',
        **options,
    )


def _answer(llm: LLM) -> tuple[list[int], list[dict[int, float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    (out,) = llm.chat(MESSAGES, params, use_tqdm=False)
    sample = out.outputs[0]
    assert sample.logprobs is not None
    logprobs = [{tok: lp.logprob for tok, lp in pos.items()} for pos in sample.logprobs]
    return list(sample.token_ids), logprobs


def _encoder(llm: LLM) -> EncoderRunner:
    client: Any = llm.engine_client
    runner = client.core.model_executor.worker.model_runner
    assert runner.encoder_runner is not None
    encoder: EncoderRunner = runner.encoder_runner
    return encoder


def _worker_connector(llm: LLM) -> ECExampleConnector:
    connector = _encoder(llm).ec_connector
    assert isinstance(connector, ECExampleConnector)
    return connector


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    started: list[LLM] = []
    yield started
    for llm in started:
        llm.shutdown()


def test_consumer_loads_embeddings_and_matches_colocated(
    model_dir: Path, tmp_path: Path, engines: list[LLM]
) -> None:
    storage = tmp_path / "ec"
    colocated = _engine(model_dir)
    engines.append(colocated)
    expected = _answer(colocated)
    assert _encoder(colocated).num_encoded_items == 2

    producer = _engine(model_dir, ec_transfer_config=_ec_config("producer", storage))
    engines.append(producer)
    assert _answer(producer) == expected
    assert _worker_connector(producer).num_saved == 2
    files = sorted(storage.glob("*/encoder_cache.safetensors"))
    assert len(files) == 2
    for file in files:  # vLLM's layout: {"ec_cache": [num_embeds, hidden]}, non-trivial
        saved = safetensors.torch.load_file(str(file))["ec_cache"]
        assert saved.shape == (4, 64) and float(saved.abs().sum()) > 0

    consumer = _engine(model_dir, ec_transfer_config=_ec_config("ec_consumer", storage))
    engines.append(consumer)
    tokens, logprobs = _answer(consumer)
    encoder = _encoder(consumer)
    assert encoder.num_encoder_calls == 0  # every embedding came from the files
    assert _worker_connector(consumer).num_loaded == 2
    assert tokens == expected[0]
    for ours, theirs in zip(logprobs, expected[1], strict=True):
        assert ours.keys() == theirs.keys()
        for tok, value in ours.items():
            assert value == pytest.approx(theirs[tok], abs=1e-5)
    # The scheduler-side connector kept nothing per request (gap 2).
    client: Any = consumer.engine_client
    assert not client.core.scheduler.state.ec_transfer.has_pending()

    # Corrupt one file, remove the other: a fresh consumer recomputes both, same output.
    data = files[0].read_bytes()
    files[0].write_bytes(data[:-16] + bytes(b ^ 0xFF for b in data[-16:]))
    files[1].unlink()
    recovering = _engine(model_dir, ec_transfer_config=_ec_config("consumer", storage))
    engines.append(recovering)
    tokens, logprobs = _answer(recovering)
    assert tokens == expected[0]
    for ours, theirs in zip(logprobs, expected[1], strict=True):
        for tok, value in ours.items():
            assert value == pytest.approx(theirs[tok], abs=1e-5)
    encoder = _encoder(recovering)
    assert _worker_connector(recovering).num_loaded == 0
    # The missing file was never offered (has_cache_item: no file); the corrupt one
    # was offered, failed its checksum and was encoded locally in the same step.
    assert encoder.num_recomputed_loads == 1
    assert encoder.num_encoded_items == 2
