"""EncoderRunner with a worker-side EC connector (vLLM's gaps 1, 3, 4).

A fake vision model (each item's output is a function of its pixels) and a
scripted connector drive one `EncoderRunner.step` at a time: the connector is
handed the preallocated buffer once (`register_caches`) and writes loaded
rows straight into it; a producer saves each encoded item; a failed load is
encoded locally with the same output; finished transfers come back as
`ECConnectorOutput`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import numpy as np
import torch

from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from paged.runner.ec_connector import ECConnectorWorker
from paged.runner.encoder_cache_buffer import PreallocatedEncoderCache
from paged.runner.encoder_runner import EncoderRunner, encoder_cache_capacity
from paged.runner.input_batch import CachedRequestState
from paged.runner.models.interface import SupportsMultiModal
from paged.scheduler.boundary import ECConnectorOutput, SchedulerOutput
from paged.scheduler.sampling_params import SamplingParams

HIDDEN = 6
EMBEDS = 4


class FakeVision:
    """embed_multimodal only: rows = pixel mean + row index, per item."""

    bidirectional_mm_attention: ClassVar[bool] = False

    def __init__(self) -> None:
        self.calls: list[int] = []

    def embed_multimodal(
        self, modality: str, items: Sequence[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        self.calls.append(len(items))
        return [
            item["pixel_values"].mean() + torch.arange(EMBEDS * HIDDEN).view(EMBEDS, HIDDEN)
            for item in items
        ]


def expected_output(seed: int) -> torch.Tensor:
    pixels = torch.from_numpy(_pixels(seed))
    return pixels.mean() + torch.arange(EMBEDS * HIDDEN, dtype=torch.float32).view(EMBEDS, HIDDEN)


def _pixels(seed: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    return np.random.default_rng(seed).random((2, 2), dtype=np.float32)


def feature(mm_hash: str, seed: int, offset: int) -> MultiModalFeatureSpec:
    pixels = _pixels(seed)
    data = {"pixel_values": TensorData("float32", list(pixels.shape), pixels.tobytes())}
    return MultiModalFeatureSpec("image", mm_hash, PlaceholderRange(offset, EMBEDS), data)


def request(rid: str, features: list[MultiModalFeatureSpec]) -> CachedRequestState:
    return CachedRequestState(
        req_id=rid,
        prompt_token_ids=list(range(20)),
        sampling_params=SamplingParams(max_tokens=1),
        block_ids=([0],),
        num_computed_tokens=0,
        mm_features=features,
    )


@dataclass
class ScriptedConnector:
    """Worker side: loads what `store` holds (or fails `broken`), records saves."""

    producer: bool = False
    consumer: bool = True
    store: dict[str, torch.Tensor] = field(default_factory=dict)
    broken: set[str] = field(default_factory=set)
    registered: list[PreallocatedEncoderCache] = field(default_factory=list)
    bound: list[bytes] = field(default_factory=list)
    saved: dict[str, torch.Tensor] = field(default_factory=dict)
    to_load: list[str] = field(default_factory=list)
    load_ptrs: list[int] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    cleared: int = 0

    @property
    def is_producer(self) -> bool:
        return self.producer

    @property
    def is_consumer(self) -> bool:
        return self.consumer

    def register_caches(self, encoder_cache: PreallocatedEncoderCache) -> None:
        self.registered.append(encoder_cache)

    def bind_connector_metadata(self, connector_metadata: bytes) -> None:
        self.bound.append(connector_metadata)
        self.to_load = connector_metadata.decode().split(",") if connector_metadata else []

    def clear_connector_metadata(self) -> None:
        self.cleared += 1
        self.to_load = []

    def start_load_caches(self, encoder_cache: PreallocatedEncoderCache, **kwargs: Any) -> None:
        for mm_hash in self.to_load:
            if mm_hash in self.broken or mm_hash not in self.store:
                self.failed.add(mm_hash)
                continue
            rows = encoder_cache.allocate(mm_hash, EMBEDS)
            rows.copy_(self.store[mm_hash])
            self.load_ptrs.append(rows.data_ptr())

    def save_caches(
        self, encoder_cache: PreallocatedEncoderCache, mm_hash: str, **kwargs: Any
    ) -> None:
        rows = encoder_cache.get(mm_hash)
        assert rows is not None
        self.saved[mm_hash] = rows.clone()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self.finished_recving = self.finished_recving, set()
        return None, done or None

    def get_failed_loads(self) -> set[str]:
        failed, self.failed = self.failed, set()
        return failed

    def shutdown(self) -> None:
        return None


_PROTOCOL_CHECK: type[ECConnectorWorker] = ScriptedConnector


def make_runner(connector: ScriptedConnector | None) -> tuple[EncoderRunner, FakeVision]:
    model = FakeVision()
    cache = PreallocatedEncoderCache(16, HIDDEN, torch.float32, torch.device("cpu"))
    runner = EncoderRunner(cast(SupportsMultiModal, model), torch.device("cpu"), cache, connector)
    return runner, model


def step(
    runner: EncoderRunner,
    requests: dict[str, CachedRequestState],
    *,
    encode: dict[str, list[int]] | None = None,
    load: list[str] | None = None,
    tokens: dict[str, int] | None = None,
    free: list[str] | None = None,
) -> ECConnectorOutput | None:
    so = SchedulerOutput(
        num_scheduled_tokens=tokens or {rid: 20 for rid in requests},
        scheduled_encoder_inputs=encode or {},
        free_encoder_mm_hashes=free or [],
        ec_connector_metadata=",".join(load).encode() if load is not None else None,
    )
    return runner.step(so, requests)


def test_register_caches_hands_over_the_preallocated_buffer_once() -> None:
    connector = ScriptedConnector()
    runner, _ = make_runner(connector)
    assert connector.registered == [runner.encoder_cache]
    assert isinstance(runner.encoder_cache, PreallocatedEncoderCache)


def test_loads_are_written_into_the_buffer_and_skip_the_encoder() -> None:
    connector = ScriptedConnector(store={"a": expected_output(1), "b": expected_output(2)})
    runner, model = make_runner(connector)
    reqs = {"r": request("r", [feature("a", 1, 2), feature("b", 2, 8)])}
    out = step(runner, reqs, load=["a", "b"])
    assert model.calls == [] and runner.num_encoder_calls == 0
    buffer = runner.encoder_cache.buffer
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    assert all(start <= p < end for p in connector.load_ptrs)  # rows of the one buffer
    for name, seed in (("a", 1), ("b", 2)):
        rows = runner.encoder_cache.get(name)
        assert rows is not None and torch.equal(rows, expected_output(seed))
    assert out == ECConnectorOutput()
    assert connector.cleared == 1  # metadata bound and cleared within the step


def test_failed_load_is_encoded_locally_with_the_same_output() -> None:
    connector = ScriptedConnector(store={"a": expected_output(1)}, broken={"a"})
    runner, model = make_runner(connector)
    reqs = {"r": request("r", [feature("a", 1, 2)])}
    out = step(runner, reqs, load=["a"])
    assert out is not None and out.failed_recving == ["a"]
    assert model.calls == [1] and runner.num_recomputed_loads == 1
    rows = runner.encoder_cache.get("a")
    assert rows is not None and torch.equal(rows, expected_output(1))


def test_failed_load_outside_this_steps_tokens_is_left_to_the_scheduler() -> None:
    connector = ScriptedConnector(broken={"late"})
    runner, model = make_runner(connector)
    reqs = {"r": request("r", [feature("late", 3, 12)])}
    out = step(runner, reqs, load=["late"], tokens={"r": 5})  # tokens [0, 5): before it
    assert out is not None and out.failed_recving == ["late"]
    assert model.calls == [] and "late" not in runner.encoder_cache


def test_producer_saves_every_encoded_item() -> None:
    connector = ScriptedConnector(producer=True, consumer=False)
    runner, model = make_runner(connector)
    reqs = {"r": request("r", [feature("a", 1, 2), feature("b", 2, 8)])}
    out = step(runner, reqs, encode={"r": [0, 1]})
    assert model.calls == [2]
    assert set(connector.saved) == {"a", "b"}
    assert torch.equal(connector.saved["b"], expected_output(2))
    assert out == ECConnectorOutput()


def test_async_completions_are_reported_even_without_scheduled_tokens() -> None:
    connector = ScriptedConnector(finished_recving={"x"})
    runner, _ = make_runner(connector)
    out = step(runner, {}, tokens={})
    assert out == ECConnectorOutput(finished_recving=["x"])


def test_freed_hashes_release_buffer_rows() -> None:
    runner, _ = make_runner(None)
    reqs = {"r": request("r", [feature("a", 1, 2)])}
    assert step(runner, reqs, encode={"r": [0]}) is None  # no connector: no report
    assert runner.encoder_cache.num_used == EMBEDS
    step(runner, {}, tokens={}, free=["a"])
    assert runner.encoder_cache.num_used == 0


def test_capacity_matches_the_scheduler_resolution() -> None:
    assert encoder_cache_capacity(2048, 256) == 2048
    assert encoder_cache_capacity(128, 256) == 256  # one item always fits
    assert encoder_cache_capacity(2048, 256, encoder_cache_size=512) == 512
    assert encoder_cache_capacity(2048, 0) == 1  # no image tokens: the minimum, one row
