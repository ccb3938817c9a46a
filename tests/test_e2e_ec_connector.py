"""Encoder-cache transfer through the real engine: ECExampleConnector, producer -> consumer.

The tiny random Gemma3 of the multimodal tests answers one two-image chat
colocated (no connector) and on a producer (`ec_producer`: saves each
encoder output as safetensors under the shared directory). A fresh consumer
engine (`ec_consumer` over the same directory) must give the same greedy
tokens and logprobs as the colocated run while running the vision encoder
zero times; so must `paged serve --ec-transfer-config` over HTTP (the
connector built in the engine process from the flag). With one file
corrupted and one removed, a consumer recomputes those items: same output.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import openai
import pytest
import safetensors.torch

from paged.connectors.ec.example import ECExampleConnector
from paged.runner.ec_connector import ECConnectorWorkerFactory
from paged.runner.encoder_runner import EncoderRunner
from paged.scheduler.sampling_params import SamplingParams
from paged.server.ec_transfer import ECConnectorBuilder
from paged.server.llm import LLM
from paged.server.mm_testing import png_data_url, save_tiny_gemma3_model

if TYPE_CHECKING:
    from tests.conftest import LiveServer

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


def _answer(llm: LLM) -> tuple[list[int], list[dict[int, float]], str]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    (out,) = llm.chat(MESSAGES, params, use_tqdm=False)
    sample = out.outputs[0]
    assert sample.logprobs is not None
    logprobs = [{tok: lp.logprob for tok, lp in pos.items()} for pos in sample.logprobs]
    return list(sample.token_ids), logprobs, sample.text


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


@dataclass
class Produced:
    """A colocated answer, and a storage directory a producer filled for the same chat."""

    storage: Path
    tokens: list[int]
    text: str
    logprobs: list[dict[int, float]]


@pytest.fixture(scope="module")
def produced(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Produced]:
    storage = tmp_path_factory.mktemp("ec-storage")
    colocated = _engine(model_dir)
    try:
        tokens, logprobs, text = _answer(colocated)
        assert _encoder(colocated).num_encoded_items == 2
    finally:
        colocated.shutdown()
    # ec_both: an ec_producer alone is an encode-only instance (vLLM's, and paged's
    # EPD producer: no language model, no tokens), so "saves while it generates" is both.
    producer = _engine(model_dir, ec_transfer_config=_ec_config("both", storage))
    try:
        assert _answer(producer) == (tokens, logprobs, text)  # saving changes nothing
        assert _worker_connector(producer).num_saved == 2
    finally:
        producer.shutdown()
    files = sorted(storage.glob("*/encoder_cache.safetensors"))
    assert len(files) == 2
    for file in files:  # vLLM's layout: {"ec_cache": [num_embeds, hidden]}, non-trivial
        saved = safetensors.torch.load_file(str(file))["ec_cache"]
        assert saved.shape == (4, 64) and float(saved.abs().sum()) > 0
    yield Produced(storage, tokens, text, logprobs)


def _assert_same_logprobs(ours: list[dict[int, float]], theirs: list[dict[int, float]]) -> None:
    assert len(ours) == len(theirs)
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.keys() == other.keys()
        for tok, value in mine.items():
            assert value == pytest.approx(other[tok], abs=1e-5)


def test_consumer_loads_embeddings_and_matches_colocated(
    model_dir: Path, produced: Produced
) -> None:
    consumer = _engine(model_dir, ec_transfer_config=_ec_config("ec_consumer", produced.storage))
    try:
        tokens, logprobs, _ = _answer(consumer)
        assert _encoder(consumer).num_encoder_calls == 0  # every embedding from the files
        assert _worker_connector(consumer).num_loaded == 2
        assert tokens == produced.tokens
        _assert_same_logprobs(logprobs, produced.logprobs)
        # Nothing held per request or in flight once the request ended (gap 2).
        client: Any = consumer.engine_client
        assert not client.core.scheduler.state.ec_transfer.has_pending()
    finally:
        consumer.shutdown()


def test_corrupt_and_missing_files_are_recomputed_with_identical_output(
    model_dir: Path, produced: Produced, tmp_path: Path
) -> None:
    storage = tmp_path / "ec"
    shutil.copytree(produced.storage, storage)
    files = sorted(storage.glob("*/encoder_cache.safetensors"))
    data = files[0].read_bytes()
    files[0].write_bytes(data[:-16] + bytes(b ^ 0xFF for b in data[-16:]))
    files[1].unlink()
    consumer = _engine(model_dir, ec_transfer_config=_ec_config("consumer", storage))
    try:
        tokens, logprobs, _ = _answer(consumer)
        assert tokens == produced.tokens
        _assert_same_logprobs(logprobs, produced.logprobs)
        encoder = _encoder(consumer)
        assert _worker_connector(consumer).num_loaded == 0
        # The missing file was never offered (has_cache_item: no file); the corrupt one
        # was offered, failed its checksum and was encoded locally in the same step.
        assert encoder.num_recomputed_loads == 1
        assert encoder.num_encoded_items == 2
    finally:
        consumer.shutdown()


def test_paged_serve_consumer_over_http(
    model_dir: Path, produced: Produced, launch_server: Callable[..., LiveServer]
) -> None:
    server = launch_server(
        str(model_dir), "--served-model-name", "tiny-gemma3", "--device", "cpu",
        "--max-model-len", "256", "--kv-cache-memory", "16MiB",
        "--limit-mm-per-prompt", '{"image": 2}',
        "--ec-transfer-config", json.dumps(_ec_config("ec_consumer", produced.storage)),
    )  # fmt: skip
    with openai.OpenAI(api_key="x", base_url=f"{server.base_url}/v1", max_retries=0) as client:
        reply = client.chat.completions.create(
            model="tiny-gemma3",
            messages=cast(Any, MESSAGES),
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    assert reply.choices[0].message.content == produced.text


def test_asynchronous_loads_hold_back_only_their_request(
    model_dir: Path, produced: Produced
) -> None:
    """Gap 1 through the real engine: embeddings land two steps after the load starts.

    Had the image's tokens run before their rows arrived, they would have read
    uninitialised buffer rows and the logprobs would differ.
    """
    config = _ec_config("ec_consumer", produced.storage)
    config["ec_connector"] = "DelayedECExampleConnector"
    config["ec_connector_module_path"] = "paged.connectors.ec.testing"
    config["ec_connector_extra_config"] = {
        "shared_storage_path": str(produced.storage),
        "delay_steps": 3,
    }
    consumer = _engine(model_dir, ec_transfer_config=config)
    try:
        text_only = [{"role": "user", "content": "hello world"}]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
        with_image, plain = consumer.chat([MESSAGES, text_only], params, use_tqdm=False)
        sample = with_image.outputs[0]
        assert list(sample.token_ids) == produced.tokens
        assert sample.logprobs is not None
        _assert_same_logprobs(
            [{t: lp.logprob for t, lp in pos.items()} for pos in sample.logprobs],
            produced.logprobs,
        )
        assert len(plain.outputs[0].token_ids) == MAX_TOKENS  # served meanwhile
        encoder = _encoder(consumer)
        assert encoder.num_encoder_calls == 0
        connector = encoder.ec_connector
        assert connector is not None and type(connector).__name__ == "DelayedECExampleConnector"
        assert cast(Any, connector).num_loaded == 2
        client: Any = consumer.engine_client
        assert not client.core.scheduler.state.ec_transfer.has_pending()
    finally:
        consumer.shutdown()
