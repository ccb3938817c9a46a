"""SharedStorageConnector: real KV tensors saved by one request come back for the next."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged.connectors.kv import (
    KVConnectorContext,
    KVConnectorRole,
    KVConnectorRoleError,
    KVTransferConfig,
)
from paged.connectors.kv.shared_storage import (
    SharedStorageConnector,
    prefix_key,
    prefix_length,
)
from paged.connectors.kv.testing import KVWorkerSim, expected_kv, make_kv_caches
from paged.scheduler.connectors import KVConnectorScheduler
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import BLOCK_SIZE, make_request, make_scheduler

NUM_BLOCKS = 32


def _config(path: Path, role: str = "kv_both") -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role=role,  # type: ignore[arg-type]
        kv_connector_extra_config={"shared_storage_path": str(path)},
    )


def _pair(
    path: Path, role: str = "kv_both"
) -> tuple[SharedStorageConnector, SharedStorageConnector]:
    ctx = KVConnectorContext(block_size=BLOCK_SIZE)
    cfg = _config(path, role)
    return (
        SharedStorageConnector(cfg, KVConnectorRole.SCHEDULER, ctx),
        SharedStorageConnector(cfg, KVConnectorRole.WORKER, ctx),
    )


# mypy proves the scheduler side satisfies the scheduler's Protocol.
_SCHEDULER_SIDE: type[KVConnectorScheduler] = SharedStorageConnector


def _run(sched: Scheduler, sim: KVWorkerSim, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if not sched.has_requests():
            return
        so = sched.schedule()
        sched.update_from_output(so, sim.execute(so))
    raise AssertionError("did not finish")


def test_prefix_length_leaves_one_token_and_is_block_aligned() -> None:
    assert prefix_length(9, 4) == 8
    assert prefix_length(8, 4) == 4  # the last token must be computed
    assert prefix_length(4, 4) == 0
    assert prefix_length(1, 4) == 0


def test_prefix_key_depends_on_tokens_and_mm_identifiers() -> None:
    assert prefix_key([1, 2, 3], []) == prefix_key([1, 2, 3], [])
    assert prefix_key([1, 2, 3], []) != prefix_key([1, 2, 4], [])
    assert prefix_key([1, 2, 3], []) != prefix_key([1, 2, 3], ["img"])


def test_save_then_load_round_trips_real_kv(tmp_path: Path) -> None:
    sched_side, worker_side = _pair(tmp_path)
    sched = make_scheduler(NUM_BLOCKS, kv_connector=sched_side)
    sim = KVWorkerSim(worker_side, make_kv_caches(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)
    prompt = list(range(10, 21))  # 11 tokens: prefix of 8
    sched.add_request(make_request("a", prompt, max_tokens=2))
    _run(sched, sim)
    key = prefix_key(prompt[:8], [])
    files = sorted(p.name for p in (tmp_path / key / "rank0").iterdir())
    assert files == [
        "COMPLETE",
        "model.layers.0.self_attn.attn.safetensors",
        "model.layers.1.self_attn.attn.safetensors",
    ]
    assert sched_side.stats.num_saves == 1 and sched_side.stats.num_hits == 0

    # Drop the device cache and zero the tensors: only the store can supply the KV.
    assert sched.reset_prefix_cache()
    for cache in sim.kv_caches.values():
        cache.zero_()
    sched.add_request(make_request("b", prompt, max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"b": 3}
    out = sim.execute(so)
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == []
    loaded = sim.kv_of("b", 8)
    for name, kv in expected_kv(prompt, 8).items():
        torch.testing.assert_close(loaded[name], kv, rtol=0, atol=0)
    # Only positions 8..10 were computed; 0..7 came from storage.
    assert sim.computed_positions["b"] == [8, 9, 10]
    assert sched_side.stats.num_hits == 1 and sched_side.stats.num_hit_tokens == 8
    sched.update_from_output(so, out)


def test_local_prefix_hit_is_not_counted_twice(tmp_path: Path) -> None:
    sched_side, worker_side = _pair(tmp_path)
    sched = make_scheduler(NUM_BLOCKS, kv_connector=sched_side)
    sim = KVWorkerSim(worker_side, make_kv_caches(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)
    prompt = list(range(10, 21))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    _run(sched, sim)
    # Same prompt again without a reset: the device cache covers the whole prefix.
    sched.add_request(make_request("b", prompt, max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert sched_side.stats.num_hits == 0
    sched.update_from_output(so, sim.execute(so))


def test_chunked_prefill_saves_only_once_the_prefix_is_computed(tmp_path: Path) -> None:
    sched_side, worker_side = _pair(tmp_path)
    sched = make_scheduler(NUM_BLOCKS, kv_connector=sched_side, max_num_batched_tokens=4)
    sim = KVWorkerSim(worker_side, make_kv_caches(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)
    prompt = list(range(30, 43))  # 13 tokens: prefix 12, computed in chunks of 4
    sched.add_request(make_request("a", prompt, max_tokens=1))
    key = prefix_key(prompt[:12], [])
    steps_until_saved = 0
    while not sched_side.is_stored(key):
        so = sched.schedule()
        sched.update_from_output(so, sim.execute(so))
        steps_until_saved += 1
    assert steps_until_saved == 3  # 0-3, 4-7, 8-11: saved in the step computing token 11
    # What was saved is the fully computed prefix, not zeros of unwritten blocks.
    _run(sched, sim)
    assert sched.reset_prefix_cache()
    for cache in sim.kv_caches.values():
        cache.zero_()
    sched.add_request(make_request("b", prompt, max_tokens=1))
    so = sched.schedule()
    sim.execute(so)
    loaded = sim.kv_of("b", 12)
    for name, kv in expected_kv(prompt, 12).items():
        torch.testing.assert_close(loaded[name], kv, rtol=0, atol=0)


def test_corrupt_file_is_a_load_error_and_recomputed(tmp_path: Path) -> None:
    sched_side, worker_side = _pair(tmp_path)
    sched = make_scheduler(NUM_BLOCKS, kv_connector=sched_side)
    sim = KVWorkerSim(worker_side, make_kv_caches(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)
    prompt = list(range(10, 21))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    _run(sched, sim)
    key = prefix_key(prompt[:8], [])
    (tmp_path / key / "rank0" / "model.layers.1.self_attn.attn.safetensors").write_bytes(b"junk")
    assert sched.reset_prefix_cache()
    sched.add_request(make_request("b", prompt, max_tokens=2))
    so = sched.schedule()
    out = sim.execute(so)
    assert out.kv_connector_output is not None
    block_ids = list(so.scheduled_new_reqs[0].block_ids[0][:2])
    assert out.kv_connector_output.invalid_block_ids == sorted(block_ids)
    sched.update_from_output(so, out)
    # The scheduler recomputes from the first bad block: the next step starts at 0.
    so = sched.schedule()
    assert so.scheduled_cached_reqs.num_computed_tokens == [0]
    assert so.num_scheduled_tokens["b"] == len(prompt)


def test_consumer_only_never_saves_and_producer_only_never_loads(tmp_path: Path) -> None:
    consumer, consumer_worker = _pair(tmp_path, "kv_consumer")
    sched = make_scheduler(NUM_BLOCKS, kv_connector=consumer)
    sim = KVWorkerSim(consumer_worker, make_kv_caches(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)
    sched.add_request(make_request("a", list(range(10, 21)), max_tokens=1))
    _run(sched, sim)
    assert list(tmp_path.iterdir()) == []

    producer, _ = _pair(tmp_path, "kv_producer")
    key = prefix_key(list(range(10, 18)), [])
    (tmp_path / key / "rank0").mkdir(parents=True)
    (tmp_path / key / "rank0" / "COMPLETE").touch()
    sched = make_scheduler(NUM_BLOCKS, kv_connector=producer)
    req = make_request("b", list(range(10, 21)), max_tokens=1)
    sched.add_request(req)
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


def test_bad_storage_path_is_rejected(tmp_path: Path) -> None:
    cfg = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": 5},
    )
    with pytest.raises(ValueError, match="shared_storage_path"):
        SharedStorageConnector(cfg, KVConnectorRole.WORKER, KVConnectorContext(block_size=4))


def test_a_hybrid_model_without_group_layouts_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no kv_cache_groups layouts"):
        SharedStorageConnector(
            _config(tmp_path),
            KVConnectorRole.SCHEDULER,
            KVConnectorContext(block_size=4, num_kv_cache_groups=2),
        )


def test_worker_methods_on_the_scheduler_side_are_refused(tmp_path: Path) -> None:
    sched_side, _ = _pair(tmp_path)
    with pytest.raises(KVConnectorRoleError, match="worker-side method"):
        sched_side.bind_connector_metadata(b"")
    with pytest.raises(KVConnectorRoleError, match="register_kv_caches"):
        sched_side.register_kv_caches({})


def test_start_load_without_bound_metadata_is_a_call_order_error(tmp_path: Path) -> None:
    _, worker_side = _pair(tmp_path)
    with pytest.raises(RuntimeError, match="bind_connector_metadata must come first"):
        worker_side.start_load_kv()


def test_blocks_of_a_local_hit_are_not_written_again(tmp_path: Path) -> None:
    sched_side, worker_side = _pair(tmp_path)
    sched = make_scheduler(NUM_BLOCKS, kv_connector=sched_side)
    sim = KVWorkerSim(worker_side, make_kv_caches(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)
    prompt = list(range(10, 21))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    _run(sched, sim)
    assert sched.reset_prefix_cache()
    # c shares only the first block with the prompt: that block is now cached locally.
    other = [*prompt[:4], 90, 91, 92, 93, 94]
    sched.add_request(make_request("c", other, max_tokens=1))
    so = sched.schedule()
    shared_block = so.scheduled_new_reqs[0].block_ids[0][0]
    sched.update_from_output(so, sim.execute(so))
    _run(sched, sim)
    for cache in sim.kv_caches.values():
        cache[:, shared_block] = 7.0  # a sentinel the load must leave alone
    sched.add_request(make_request("b", prompt, max_tokens=1))
    so = sched.schedule()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8 and new.block_ids[0][0] == shared_block
    assert sched_side.stats.num_hit_tokens == 4  # only the block beyond the local hit
    sim.execute(so)
    loaded = sim.kv_of("b", 8)
    for name, kv in expected_kv(prompt, 8).items():
        assert bool((loaded[name][:, :4] == 7.0).all())
        torch.testing.assert_close(loaded[name][:, 4:], kv[:, 4:], rtol=0, atol=0)
