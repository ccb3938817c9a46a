"""vLLM 0.33's OffloadingConnector extra config: its mapping onto paged's tiers, refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paged.connectors.kv.offloading.admission import StoreAdmission
from paged.connectors.kv.offloading.arc import ArcTierIndex
from paged.connectors.kv.offloading.chunks import ChunkKey
from paged.connectors.kv.offloading.config import OffloadingConfig, check_extra_config
from paged.connectors.kv.offloading.index import TierIndex


def test_vllm_docs_multi_tier_example_maps_onto_host_and_disk(tmp_path: Path) -> None:
    # vLLM 0.33 docs/features/kv_offloading_usage.md, "Multi-Tier Setup".
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 10737418240,
        "block_size": 16,
        "eviction_policy": "lru",
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 32, "n_write_threads": 16}
        ],
    }
    cfg = OffloadingConfig.from_extra_config(extra, 16, world_size=2)
    assert cfg.chunk_size == 16
    assert cfg.host_bytes == 10737418240 // 2  # "across all workers (not per-worker)"
    assert cfg.disk_path == tmp_path and cfg.offload_prompt_only
    assert cfg.store_threshold == 0


def test_vllm_docs_single_tier_example_and_chunk_keys() -> None:
    cfg = OffloadingConfig.from_extra_config({"block_size": 64, "cpu_bytes_to_use": 1e9}, 16)
    assert (cfg.chunk_size, cfg.host_bytes, cfg.disk_path) == (64, 1_000_000_000, None)
    cfg = OffloadingConfig.from_extra_config({"blocks_per_chunk": 4, "cpu_bytes_to_use": 1}, 16)
    assert cfg.chunk_size == 64
    cfg = OffloadingConfig.from_extra_config(
        {
            "cpu_bytes_to_use": 1,
            "store_threshold": 3,
            "max_tracker_size": 10,
            "offload_prompt_only": False,
            "sync_load_budget_bytes": 0,
            "tier_poll_interval_s": 0.001,
        },
        16,
    )
    assert (cfg.store_threshold, cfg.max_tracker_size, cfg.offload_prompt_only) == (3, 10, False)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"num_cpu_blocks": 100}, "num_cpu_blocks is not supported.*cpu_bytes_to_use"),
        ({"cpu_bytes_to_use_per_rank": 1}, "cpu_bytes_to_use_per_rank is not supported"),
        ({"cpu_bytes_to_use": 1, "eviction_policy": "lfu"}, "'lfu'.*\\['lru', 'arc'\\]"),
        ({"cpu_bytes_to_use": 1, "spec_name": "MySpec"}, "spec_name 'MySpec'"),
        ({"cpu_bytes_to_use": 1, "spec_module_path": "x.y"}, "spec_module_path"),
        ({"cpu_bytes_to_use": 1, "cache_policy_module_path": "x"}, "cache_policy_module_path"),
        ({"cpu_bytes_to_use": 1, "canonical_layout": True}, "canonical_layout=true"),
        ({"cpu_bytes_to_use": 1, "self_describing_kv_events": 1}, "self_describing_kv_events must"),
        ({"cpu_bytes_to_use": 1, "block_size": 16, "blocks_per_chunk": 1}, "only one of"),
        ({"cpu_bytes_to_use": 1, "block_size": 24}, "block_size 24 must be a positive multiple"),
        ({"cpu_bytes_to_use": 1, "blocks_per_chunk": 0}, "blocks_per_chunk must be greater"),
        ({"cpu_bytes_to_use": 1, "kv_bytes_per_rank": 1}, "exclusive"),
        ({"cpu_bytes_to_use": 1, "offload_prompt_only": "yes"}, "offload_prompt_only must be"),
        ({"cpu_bytes_to_use": "10GB"}, "cpu_bytes_to_use must be a number"),
        (
            {"cpu_bytes_to_use": 1, "bogus": 1},
            "unknown kv_connector_extra_config keys \\['bogus'\\]",
        ),
        (
            {"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "fs", "root_dir": "/x"}]},
            "secondary_tiers needs .*TieringOffloadingSpec",
        ),
        (
            {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1, "store_threshold": 2},
            "store_threshold >= 2 is not supported with TieringOffloadingSpec",
        ),
    ],
)
def test_keys_paged_does_not_implement_are_refused_by_name(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_extra_config(extra, 16, 1)


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        ({"type": "obj", "bucket": "b"}, "type 'obj' \\(an object-store tier\\).*\"fs\""),
        ({"type": "p2p"}, "type 'p2p'"),
        ({"type": "fs"}, "needs root_dir"),
        ({"type": "fs", "root_dir": "/x", "locality": "LOCAL"}, "\\['locality'\\]"),
        ({"type": "fs", "root_dir": "/x", "backpressure": {}}, "\\['backpressure'\\]"),
        ({"type": "fs", "root_dir": "/x", "n_read_threads": 0}, "n_read_threads"),
    ],
)
def test_secondary_tiers_other_than_one_fs_tier_are_refused(
    tier: dict[str, Any], message: str
) -> None:
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1, "secondary_tiers": [tier]}
    with pytest.raises(ValueError, match=message):
        check_extra_config(extra, 16, 1)


def test_two_secondary_tiers_or_a_disk_path_beside_the_fs_tier_are_refused() -> None:
    fs = {"type": "fs", "root_dir": "/x"}
    base = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1}
    with pytest.raises(ValueError, match="paged has at most one"):
        check_extra_config({**base, "secondary_tiers": [fs, fs]}, 16, 1)
    with pytest.raises(ValueError, match="disk_path and a secondary_tiers fs tier"):
        check_extra_config({**base, "secondary_tiers": [fs], "disk_path": "/y"}, 16, 1)


def test_store_admission_counts_offers_in_a_bounded_table() -> None:
    a, b, c = ChunkKey("a"), ChunkKey("b"), ChunkKey("c")
    off = StoreAdmission(1, 10)
    assert not off.enabled and off.admit(a)  # < 2: every chunk is stored
    adm = StoreAdmission(2, 2)
    adm.record([a, b])
    assert not adm.admit(a) and adm.skipped == 1
    adm.record([a])
    assert adm.admit(a)
    adm.record([c])  # the table is full: b, the least recently offered, makes room
    assert len(adm) == 2
    adm.record([b])
    assert not adm.admit(b)  # b's first offer was forgotten
    full = StoreAdmission(2, 1)
    full.record([a, b])  # an offer never evicts its own keys: b goes uncounted
    assert len(full) == 1


def _scan_after_reuse(index: TierIndex) -> list[ChunkKey]:
    """a, b reused, then c, d and a one-off scan e, f, g: what the tier keeps."""
    a, b, c, d, e, f, g = (ChunkKey(k) for k in "abcdefg")
    for key in (a, b):
        index.insert(key, 1)
    index.touch(a)
    index.touch(b)
    for key in (c, d, e, f, g):
        index.insert(key, 1)
    index.check_integrity()
    return sorted(index.keys_lru_first())


def test_arc_keeps_reused_chunks_through_a_scan_where_lru_loses_them() -> None:
    assert _scan_after_reuse(TierIndex("host", 4)) == ["d", "e", "f", "g"]
    arc = ArcTierIndex("host", 4)
    assert _scan_after_reuse(arc) == ["a", "b", "f", "g"]  # T1 gave way, T2 stayed
    assert arc.frequent_keys() == ["a", "b"] and arc.num_evictions == 3
    # c was evicted from T1 too early: storing it again grows T1's target by one,
    # and the next eviction still comes from T1 (2 chunks >= target 1).
    result = arc.insert(ChunkKey("c"), 1)
    assert arc.target_t1 == 1.0 and result.evicted == ["f"]
    assert arc.recent_keys() == ["g", "c"]
    arc.remove(ChunkKey("a"))
    assert arc.frequent_keys() == ["b"] and len(arc) == 3
    arc.check_integrity()


def test_eviction_policy_arc_gives_the_host_tier_an_arc_index() -> None:
    cfg = OffloadingConfig.from_extra_config({"cpu_bytes_to_use": 1, "eviction_policy": "arc"}, 16)
    assert cfg.eviction_policy == "arc"
