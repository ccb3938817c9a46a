"""Hybrid models (full + sliding-window KV cache groups) through every connector.

The scheduler runs a real hybrid KV cache (layer 0 full attention, layer 1 a
sliding window of `WINDOW` tokens, one block pool); the simulated worker
writes K/V that depend only on (layer, position, token). A sliding-window
group needs only the blocks of the window before the resume point
(`groups.window_start_block`): connectors store and move those alone.
"""

from __future__ import annotations

from pathlib import Path

import safetensors
import torch

from paged.connectors.kv import KVConnectorRole, KVTransferConfig
from paged.connectors.kv.groups import window_start_block
from paged.connectors.kv.shared_storage import SharedStorageConnector, prefix_key
from paged.connectors.kv.testing import (
    HYBRID_LAYER_GROUPS,
    KVWorkerSim,
    expected_kv,
    hybrid_context,
    hybrid_kv_config,
    layer_name,
    make_kv_caches,
)
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import BLOCK_SIZE, make_request

NUM_BLOCKS = 64
WINDOW = 6  # a resume at token t needs blocks from (t - 5) // 4 on
WINDOWS = (None, WINDOW)


def _scheduler(connector: object) -> Scheduler:
    config = SchedulerConfig(max_model_len=256, max_num_seqs=8)
    return Scheduler(
        config,
        hybrid_kv_config(NUM_BLOCKS, BLOCK_SIZE, WINDOW),
        BLOCK_SIZE,
        kv_connector=connector,
        hash_seed=0,
    )


def _run(sched: Scheduler, sim: KVWorkerSim) -> None:
    for _ in range(200):
        if not sched.has_requests():
            return
        so = sched.schedule()
        sched.update_from_output(so, sim.execute(so))
    raise AssertionError("did not finish")


def _firsts(num_tokens: int) -> list[int]:
    """Per layer, the first token a resume at `num_tokens` needs (layer 1 is sliding)."""
    return [
        window_start_block(w, num_tokens, BLOCK_SIZE) * BLOCK_SIZE for w in WINDOWS
    ]


def _assert_window_kv(sim: KVWorkerSim, rid: str, prompt: list[int], n: int) -> None:
    loaded = sim.window_kv_of(rid, n, WINDOWS)
    for name, kv in expected_kv(prompt, n, _firsts(n)).items():
        torch.testing.assert_close(loaded[name], kv, rtol=0, atol=0)


# ------------------------------------------------------------------ shared storage
def _storage_pair(path: Path) -> tuple[SharedStorageConnector, SharedStorageConnector]:
    cfg = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(path)},
    )
    ctx = hybrid_context(BLOCK_SIZE, WINDOW)
    return (
        SharedStorageConnector(cfg, KVConnectorRole.SCHEDULER, ctx),
        SharedStorageConnector(cfg, KVConnectorRole.WORKER, ctx),
    )


def test_shared_storage_round_trips_both_groups_and_the_window_only(tmp_path: Path) -> None:
    sched_side, worker_side = _storage_pair(tmp_path)
    sched = _scheduler(sched_side)
    sim = KVWorkerSim(
        worker_side,
        make_kv_caches(NUM_BLOCKS, BLOCK_SIZE),
        BLOCK_SIZE,
        layer_groups=HYBRID_LAYER_GROUPS,
    )
    prompt = list(range(10, 31))  # 21 tokens: a prefix of 20 (5 blocks)
    sched.add_request(make_request("a", prompt, max_tokens=2))
    _run(sched, sim)
    rank_dir = tmp_path / prefix_key(prompt[:20], []) / "rank0"
    stored: dict[str, tuple[int, int]] = {}
    for layer in (0, 1):
        with safetensors.safe_open(str(rank_dir / f"{layer_name(layer)}.safetensors"), "pt") as f:
            first = int((f.metadata() or {})["first_token"])
            stored[layer_name(layer)] = (first, f.get_tensor("kv_cache").shape[1])
    # Full layer: all 20 tokens; sliding layer: blocks 3 and 4 (tokens 12..19) only,
    # the window of a resume at token 20 (tokens 15..19).
    assert stored == {layer_name(0): (0, 20), layer_name(1): (12, 8)}

    assert sched.reset_prefix_cache()
    for cache in sim.kv_caches.values():
        cache.zero_()
    sched.add_request(make_request("b", prompt, max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20
    # The sliding group's table holds null blocks before the window.
    sliding_ids = so.scheduled_new_reqs[0].block_ids[1]
    assert sliding_ids[:3] == [0, 0, 0] and 0 not in sliding_ids[3:]
    out = sim.execute(so)
    assert out.kv_connector_output is not None
    assert out.kv_connector_output.invalid_block_ids == []
    _assert_window_kv(sim, "b", prompt, 20)
    assert sim.computed_positions["b"] == [20]
    sched.update_from_output(so, out)
