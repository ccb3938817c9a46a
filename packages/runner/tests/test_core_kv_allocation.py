"""allocate_kv_caches: one view per layer; hybrid groups share each buffer; clear errors."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from paged.kvcache import KVCacheTensor, get_kv_cache_config
from paged.kvcache.specs import FullAttentionSpec, SlidingWindowSpec
from paged.runner.kv_cache_setup import allocate_kv_caches

CPU = torch.device("cpu")


def _specs() -> dict[str, FullAttentionSpec | SlidingWindowSpec]:
    full = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    window = SlidingWindowSpec(
        block_size=4, num_kv_heads=2, head_size=8, dtype="float32", sliding_window=8
    )
    return {"l0": full, "l1": window, "l2": full, "l3": window}


def test_single_group_gets_one_buffer_per_layer() -> None:
    specs = {name: FullAttentionSpec(4, 2, 8, "float32") for name in ("a", "b")}
    config = get_kv_cache_config(specs, 1 << 16)
    caches = allocate_kv_caches(config, specs, CPU)
    assert [c.shape for c in caches] == [(2, config.num_blocks, 4, 2, 8)] * 2
    assert caches[0].data_ptr() != caches[1].data_ptr()
    assert all(c.dtype == torch.float32 and not c.any() for c in caches)


def test_hybrid_groups_share_each_buffer_between_one_layer_per_group() -> None:
    specs = _specs()
    config = get_kv_cache_config(specs, 1 << 16)
    assert len(config.kv_cache_groups) == 2
    caches = dict(zip(specs, allocate_kv_caches(config, specs, CPU), strict=True))
    for tensor in config.kv_cache_tensors:
        assert len(tensor.shared_by) == 2
        first, second = (caches[name] for name in tensor.shared_by)
        assert first.data_ptr() == second.data_ptr()  # one buffer, two groups
    assert len({c.data_ptr() for c in caches.values()}) == 2
    assert {c.shape for c in caches.values()} == {(2, config.num_blocks, 4, 2, 8)}


def test_allocation_errors_name_the_problem() -> None:
    specs = _specs()
    config = get_kv_cache_config(specs, 1 << 16)
    with pytest.raises(ValueError, match=r"layers \['extra'\] have no KV cache group"):
        allocate_kv_caches(config, {**specs, "extra": specs["l0"]}, CPU)
    lonely = replace(config, kv_cache_tensors=config.kv_cache_tensors[:1])
    with pytest.raises(ValueError, match="have no KV cache tensor"):
        allocate_kv_caches(lonely, specs, CPU)
    small = replace(config, kv_cache_tensors=[KVCacheTensor(64, ["l0", "l1"])])
    with pytest.raises(ValueError, match=r"needs \d+ bytes"):
        allocate_kv_caches(small, {"l0": specs["l0"], "l1": specs["l1"]}, CPU)
    ghost = replace(config, kv_cache_tensors=[*config.kv_cache_tensors, KVCacheTensor(64, ["x"])])
    with pytest.raises(ValueError, match="unknown layer 'x'"):
        allocate_kv_caches(ghost, specs, CPU)


def test_a_rank_with_fewer_kv_heads_views_its_own_head_count() -> None:
    # Uneven TP head split: the config comes from rank 0 (2 KV heads), this rank holds 1.
    rank0 = {name: FullAttentionSpec(4, 2, 8, "float32") for name in ("a", "b")}
    config = get_kv_cache_config(rank0, 1 << 16)
    mine = {name: FullAttentionSpec(4, 1, 8, "float32") for name in ("a", "b")}
    caches = allocate_kv_caches(config, mine, CPU)
    assert [c.shape for c in caches] == [(2, config.num_blocks, 4, 1, 8)] * 2
    # Anything else (more heads, another head size) keeps the config's spec, as before.
    more = {name: FullAttentionSpec(4, 4, 8, "float32") for name in ("a", "b")}
    assert [c.shape[3] for c in allocate_kv_caches(config, more, CPU)] == [2, 2]
    other = {name: FullAttentionSpec(4, 1, 16, "float32") for name in ("a", "b")}
    assert [c.shape[3:] for c in allocate_kv_caches(config, other, CPU)] == [(2, 8)] * 2


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="no procfs")
def test_a_cpu_cache_is_zero_without_writing_its_memory_up_front() -> None:
    """A GiB-sized cache: zeros, 64-byte aligned views, and no memory taken until written
    (torch.zeros wrote all of it: the default ~5 GiB CPU cache cost seconds of start-up)."""
    specs = {name: FullAttentionSpec(16, 8, 64, "bfloat16") for name in ("a", "b")}
    config = get_kv_cache_config(specs, 1 << 30)
    before = _rss_bytes()
    caches = allocate_kv_caches(config, specs, CPU)
    assert _rss_bytes() - before < 64 << 20
    for cache in caches:
        assert cache.data_ptr() % 64 == 0
        assert cache.numel() * 2 == config.kv_cache_tensors[0].size
        assert not bool(cache[:, :8].any()) and not bool(cache[:, -8:].any())
    caches[0][1, 3] = 1.5  # written: the layers' views stay apart
    assert not bool(caches[1].any()) and float(caches[0][1, 3].float().mean()) == 1.5
