"""Layer-wise loads and saves: `LayerwiseLoad`, `LayerwiseSave`, and OffloadingConnector on them.

The connector tests drive a real Scheduler and the runner-order worker
simulation (`KVWorkerSim`: per layer wait_for_layer_load, write, save_kv_layer)
and compare the KV in the paged cache with the KV computed from scratch.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from paged.connectors.kv import KVConnectorContext, KVConnectorRole, KVTransferConfig
from paged.connectors.kv.layerwise import (
    LayerRows,
    LayerSource,
    LayerwiseLoad,
    LayerwiseSave,
    SaveTarget,
    cross_layer_rows,
)
from paged.connectors.kv.offloading import OffloadingConnector
from paged.connectors.kv.offloading.config import OffloadingConfig
from paged.connectors.kv.offloading.metadata import ChunkLoad
from paged.connectors.kv.testing import (
    HEAD_SIZE,
    NUM_HEADS,
    NUM_LAYERS,
    KVWorkerSim,
    expected_kv,
    make_kv_caches,
)
from paged.scheduler.boundary import FinishReason, ModelRunnerOutput, SchedulerOutput
from paged.scheduler.testing import BLOCK_SIZE, make_request, make_scheduler

NUM_BLOCKS = 48
CHUNK = 8  # two blocks of 4
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_HEADS * HEAD_SIZE * 4
PROMPT = list(range(10, 37))  # 27 tokens: three full chunks and three tokens
HIT = 24


def _layers(num_layers: int = 3, num_blocks: int = 6) -> list[torch.Tensor]:
    return [torch.zeros(2, num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE) for _ in range(num_layers)]


def _part(num_blocks: int, num_layers: int, value: float) -> LayerRows:
    part = torch.full((num_blocks, num_layers, 2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE), value)
    return cross_layer_rows(part)


# --------------------------------------------------------------------- LayerwiseLoad
class _GatedLoad(LayerwiseLoad):
    """Copies layer 0 at once and every later layer only once `gate` is set."""

    gate = threading.Event()

    def _copy_layer(self, layer_idx: int, parts: Any) -> bool:
        if layer_idx > 0 and not self.gate.wait(10):
            raise AssertionError("the gate was never opened")
        return super()._copy_layer(layer_idx, parts)


def test_a_layer_is_usable_before_the_later_layers_are_loaded() -> None:
    layers = _layers()
    _GatedLoad.gate = threading.Event()
    load = _GatedLoad(layers, [LayerSource([1, 3], lambda: _part(2, 3, 5.0))], timeout_s=10)
    load.wait(0)  # returns while layers 1 and 2 are still held back
    assert bool((layers[0][:, [1, 3]] == 5.0).all())
    assert bool((layers[1] == 0).all()) and bool((layers[2] == 0).all())
    _GatedLoad.gate.set()
    load.wait(2)
    assert bool((layers[2][:, [1, 3]] == 5.0).all())
    assert bool((layers[2][:, [0, 2, 4, 5]] == 0).all())  # other blocks untouched
    assert load.finish() == set()


def test_a_fetch_error_fails_only_its_own_blocks() -> None:
    layers = _layers()

    def broken() -> LayerRows:
        raise OSError("disk gone")

    sources = [LayerSource([0], broken), LayerSource([2], lambda: _part(1, 3, 1.0))]
    load = LayerwiseLoad(layers, sources, timeout_s=10)
    for i in range(3):
        load.wait(i)
    assert load.finish() == {0}
    assert load.failed_sources == 1 and not load.cancelled
    assert bool((layers[2][:, 2] == 1.0).all())


def test_a_copy_error_in_one_layer_fails_the_blocks_and_later_layers_do_not_hang() -> None:
    layers = _layers()
    layers[1] = torch.zeros(2, 6, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE + 1)  # layer 1 cannot take it
    load = LayerwiseLoad(layers, [LayerSource([4], lambda: _part(1, 3, 2.0))], timeout_s=10)
    started = time.monotonic()
    for i in range(3):
        load.wait(i)
    assert time.monotonic() - started < 5
    assert load.finish() == {4}


def test_a_stuck_fetch_is_cancelled_at_the_deadline_and_never_writes_afterwards() -> None:
    layers = _layers()
    release = threading.Event()

    def stuck() -> LayerRows:
        release.wait(10)
        return _part(1, 3, 9.0)

    load = LayerwiseLoad(layers, [LayerSource([5], stuck)], timeout_s=0.2)
    started = time.monotonic()
    load.wait(0)
    assert 0.1 < time.monotonic() - started < 5
    assert load.cancelled
    load.wait(1)  # returns at once after the cancel
    assert load.finish() == {5}
    release.set()  # the fetch now returns: the cancelled thread must not copy it
    time.sleep(0.2)
    assert all(bool((layer == 0).all()) for layer in layers)


def test_layerwise_load_rejects_a_non_positive_deadline() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        LayerwiseLoad(_layers(), [], timeout_s=0)


def test_layerwise_save_copies_each_layer_when_it_is_saved() -> None:
    layers = _layers(num_layers=2)
    layers[0][:, 3] = 1.0
    layers[1][:, 3] = 2.0
    target = SaveTarget(
        [3], torch.zeros(1, 2, 2, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE), torch.tensor([3])
    )
    save = LayerwiseSave(layers, [target])
    save.save_layer(0)
    layers[0][:, 3] = 7.0  # after its save: not in the chunk
    assert bool((target.buffer[:, 0] == 1.0).all()) and bool((target.buffer[:, 1] == 0).all())
    (done,) = save.finish()  # layer 1, never saved by the forward, is copied now
    assert bool((done.buffer[:, 1] == 2.0).all()) and bool((done.buffer[:, 0] == 1.0).all())


# --------------------------------------------------------------------- the connector
class _Engine:
    def __init__(self, extra: dict[str, Any], policy: str = "recompute") -> None:
        cfg = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"chunk_size": CHUNK, "kv_bytes_per_rank": 1 << 20, **extra},
        )
        ctx = KVConnectorContext(block_size=BLOCK_SIZE, kv_bytes_per_block=BLOCK_BYTES)
        self.sched_side = OffloadingConnector(cfg, KVConnectorRole.SCHEDULER, ctx)
        self.worker_side = OffloadingConnector(cfg, KVConnectorRole.WORKER, ctx)
        self.sched = make_scheduler(
            NUM_BLOCKS, kv_connector=self.sched_side, kv_load_failure_policy=policy
        )
        self.sim = KVWorkerSim(self.worker_side, make_kv_caches(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)

    def step(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        so = self.sched.schedule()
        out = self.sim.execute(so)
        self.sched.update_from_output(so, out)
        return so, out

    def run(self, rid: str, prompt: list[int]) -> None:
        self.sched.add_request(make_request(rid, prompt, max_tokens=1))
        for _ in range(20):
            if not self.sched.has_requests():
                self.worker_side.worker_side.writer.flush()
                return
            self.step()
        raise AssertionError("did not finish")

    def saved_then_forgotten(self) -> None:
        self.run("a", PROMPT)
        assert self.sched.reset_prefix_cache()
        for cache in self.sim.kv_caches.values():
            cache.zero_()


def _assert_kv(engine: _Engine, rid: str, num_tokens: int) -> None:
    loaded = engine.sim.kv_of(rid, num_tokens)
    for name, kv in expected_kv(PROMPT, num_tokens).items():
        torch.testing.assert_close(loaded[name], kv, rtol=0, atol=0)


@pytest.mark.parametrize("layerwise", [False, True])
def test_host_tier_hit_loads_identical_kv_with_and_without_layerwise(layerwise: bool) -> None:
    engine = _Engine({"use_layerwise": layerwise})
    engine.saved_then_forgotten()
    engine.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so, out = engine.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == HIT
    assert out.kv_connector_output is not None and out.kv_connector_output.invalid_block_ids == []
    _assert_kv(engine, "b", HIT)
    assert engine.sim.computed_positions["b"] == [24, 25, 26]  # 0..23 came from the host tier
    engine.worker_side.shutdown()


def test_layerwise_saves_store_the_chunks_the_forward_wrote() -> None:
    engine = _Engine({"use_layerwise": True})
    engine.run("a", PROMPT)
    host = engine.worker_side.worker_side.host
    assert host is not None and len(host) == 3
    engine.sched.reset_prefix_cache()
    for cache in engine.sim.kv_caches.values():
        cache.zero_()
    engine.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    engine.step()
    _assert_kv(engine, "b", HIT)  # what was saved layer by layer loads back exactly
    engine.worker_side.shutdown()


def test_a_layerwise_load_error_is_recomputed_with_identical_kv() -> None:
    engine = _Engine({"use_layerwise": True})
    engine.saved_then_forgotten()
    worker = engine.worker_side.worker_side
    assert worker.host is not None
    second_chunk = engine.sched_side.scheduler_side.host
    assert second_chunk is not None
    key = second_chunk.keys_lru_first()[1]
    worker.host.put(key, torch.zeros(1))  # chunk 1 is damaged: its fetch fails in the thread
    engine.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so, out = engine.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == HIT
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == list(
        so.scheduled_new_reqs[0].block_ids[0][2:4]
    )
    so, _ = engine.step()  # rewound to block 2 (token 8): the rest is recomputed
    assert so.scheduled_cached_reqs.num_computed_tokens == [8]
    assert so.num_scheduled_tokens == {"b": 19}
    _assert_kv(engine, "b", 27)
    engine.worker_side.shutdown()


def test_a_stuck_layerwise_load_fails_the_request_blocks_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = _Engine({"use_layerwise": True, "layerwise_load_timeout_s": 0.2})
    engine.saved_then_forgotten()
    worker = engine.worker_side.worker_side
    release = threading.Event()
    real_fetch = worker._fetch

    def stuck_fetch(load: ChunkLoad) -> Any:
        release.wait(10)
        return real_fetch(load)

    monkeypatch.setattr(worker, "_fetch", stuck_fetch)
    engine.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    started = time.monotonic()
    so, out = engine.step()
    assert time.monotonic() - started < 5
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == sorted(
        so.scheduled_new_reqs[0].block_ids[0][:6]
    )
    release.set()
    monkeypatch.setattr(worker, "_fetch", real_fetch)
    so, _ = engine.step()  # every loaded block failed: recomputed from token 0
    assert so.scheduled_cached_reqs.num_computed_tokens == [0]
    _assert_kv(engine, "b", 27)
    engine.worker_side.shutdown()


def test_a_stuck_layerwise_load_under_the_fail_policy_finishes_the_request_with_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = _Engine({"use_layerwise": True, "layerwise_load_timeout_s": 0.2}, policy="fail")
    engine.saved_then_forgotten()
    worker = engine.worker_side.worker_side
    release = threading.Event()
    real_fetch = worker._fetch

    def stuck_fetch(load: ChunkLoad) -> Any:
        release.wait(10)
        return real_fetch(load)

    monkeypatch.setattr(worker, "_fetch", stuck_fetch)
    engine.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = engine.sched.schedule()
    started = time.monotonic()
    outputs = engine.sched.update_from_output(so, engine.sim.execute(so))
    assert time.monotonic() - started < 5
    release.set()
    (out,) = [o for per_client in outputs.values() for o in per_client.outputs]
    assert out.request_id == "b" and out.finish_reason is FinishReason.ERROR
    engine.step()  # reports b as finished to the worker
    assert not engine.sched.has_requests()
    engine.sched.check_integrity()
    engine.worker_side.shutdown()


def test_a_forward_that_raises_still_stops_the_load_thread() -> None:
    engine = _Engine({"use_layerwise": True})
    engine.saved_then_forgotten()
    engine.sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = engine.sched.schedule()
    conn = engine.worker_side
    assert so.kv_connector_metadata is not None
    conn.bind_connector_metadata(so.kv_connector_metadata)
    conn.start_load_kv()
    conn.clear_connector_metadata()  # the runner's abort(): no wait_for_save
    assert conn.worker_side._layer_load is None  # joined, not left running
    conn.shutdown()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"use_layerwise": "yes"}, "use_layerwise must be true or false"),
        ({"layerwise_load_timeout_s": 0}, "layerwise_load_timeout_s must be > 0"),
        ({"layerwise_load_timeout_s": "1"}, "layerwise_load_timeout_s must be a number"),
    ],
)
def test_bad_layerwise_keys_are_named(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OffloadingConfig.from_extra_config({"cpu_bytes_to_use": 1 << 20, **extra}, BLOCK_SIZE)


def test_layerwise_keys_are_accepted_and_default_off() -> None:
    assert not OffloadingConfig.from_extra_config(
        {"cpu_bytes_to_use": 1 << 20}, BLOCK_SIZE
    ).use_layerwise
    cfg = OffloadingConfig.from_extra_config(
        {"cpu_bytes_to_use": 1 << 20, "use_layerwise": True, "layerwise_load_timeout_s": 2},
        BLOCK_SIZE,
    )
    assert cfg.use_layerwise and cfg.layerwise_load_timeout_s == 2
