"""Head partition over TP ranks: vLLM's layout where vLLM accepts the size, valid elsewhere."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged.runner.layers.head_partition import (
    HeadShard,
    head_shard,
    is_vllm_even_split,
    partition_heads,
)


def vllm_layout(heads: int, kv_heads: int, tp: int) -> list[HeadShard]:
    """vLLM's QKVParallelLinear: even q split; KV split or one replicated head per rank."""
    per_rank = heads // tp
    if kv_heads >= tp:
        kv_per_rank = kv_heads // tp
        return [HeadShard(r * per_rank, per_rank, r * kv_per_rank, kv_per_rank) for r in range(tp)]
    replicas = tp // kv_heads
    return [HeadShard(r * per_rank, per_rank, r // replicas, 1) for r in range(tp)]


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, int, int]:
    kv_heads = draw(st.integers(1, 16))
    group = draw(st.integers(1, 8))
    heads = kv_heads * group
    tp = draw(st.integers(1, heads))
    return heads, kv_heads, tp


@given(shapes())
def test_every_q_head_once_and_reads_its_own_kv_head(shape: tuple[int, int, int]) -> None:
    heads, kv_heads, tp = shape
    shards = partition_heads(heads, kv_heads, tp)
    assert len(shards) == tp
    group = heads // kv_heads
    covered: list[int] = []
    for s in shards:
        assert s.num_heads >= 1 and s.num_kv_heads >= 1
        # Uniform GQA inside the rank: the attention backends need no change.
        assert s.num_heads % s.num_kv_heads == 0 or s.num_kv_heads == 1
        for local in range(s.num_heads):
            q = s.q_start + local
            local_kv = local // max(1, s.num_heads // s.num_kv_heads)
            assert s.kv_start + local_kv == q // group  # the KV head the checkpoint pairs it with
        covered.extend(range(s.q_start, s.q_start + s.num_heads))
    assert covered == list(range(heads))  # contiguous, rank order: o_proj columns split cleanly
    # Rank 0 holds the most KV heads, so KV blocks sized from its spec fit every rank.
    assert shards[0].num_kv_heads == max(s.num_kv_heads for s in shards)
    # KV heads are replicated only when there are fewer than ranks.
    if kv_heads >= tp:
        assert sum(s.num_kv_heads for s in shards) == kv_heads
    else:
        assert all(s.num_kv_heads == 1 for s in shards)
        assert {s.kv_start for s in shards} == set(range(kv_heads))
    # Balanced: no rank holds more than one GQA group (or one head) more than another.
    counts = [s.num_heads for s in shards]
    assert max(counts) - min(counts) <= max(group, 1)


@given(shapes())
def test_matches_vllm_wherever_vllm_accepts(shape: tuple[int, int, int]) -> None:
    heads, kv_heads, tp = shape
    if is_vllm_even_split(heads, kv_heads, tp):
        assert partition_heads(heads, kv_heads, tp) == vllm_layout(heads, kv_heads, tp)


def test_default_model_at_tp2_and_tp4() -> None:
    # SmolLM2-135M: 9 q heads, 3 KV heads (vLLM refuses TP=2 and TP=4).
    assert not is_vllm_even_split(9, 3, 2)
    assert partition_heads(9, 3, 2) == [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]
    assert partition_heads(9, 3, 4) == [
        HeadShard(0, 2, 0, 1),
        HeadShard(2, 1, 0, 1),
        HeadShard(3, 3, 1, 1),
        HeadShard(6, 3, 2, 1),
    ]
    assert head_shard(9, 3, 1, 2) == HeadShard(6, 3, 2, 1)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size: 10 is more than"):
        partition_heads(9, 3, 10)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        partition_heads(9, 2, 2)
    with pytest.raises(ValueError, match="tp_rank"):
        head_shard(9, 3, 2, 2)
