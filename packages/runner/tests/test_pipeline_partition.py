"""Pipeline parallelism without processes: layer partition, stage coordinates, KV per stage."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged.kvcache import FullAttentionSpec, get_kv_cache_config
from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from paged.runner.pipeline.kv import pipeline_kv_cache_config, stage_kv_cache_config
from paged.runner.pipeline.partition import layer_partition, layer_range
from paged.runner.pipeline.stage import PipelineStage, output_rank


@pytest.mark.parametrize(
    ("layers", "pp", "want"),
    [
        (30, 2, [15, 15]),
        (30, 4, [7, 8, 8, 7]),  # remainder to the stages before the last, from the back
        (5, 2, [3, 2]),
        (7, 3, [2, 3, 2]),
        (8, 3, [3, 3, 2]),
        (4, 4, [1, 1, 1, 1]),
    ],
)
def test_partition_follows_vllm(layers: int, pp: int, want: list[int]) -> None:
    assert layer_partition(layers, pp) == want


@given(st.integers(1, 200), st.integers(1, 16))
def test_partition_covers_every_layer_once(layers: int, pp: int) -> None:
    if layers < pp:
        with pytest.raises(ValueError, match="every stage needs at least one"):
            layer_partition(layers, pp)
        return
    counts = layer_partition(layers, pp)
    assert sum(counts) == layers and min(counts) >= 1 and max(counts) - min(counts) <= 1
    assert counts[-1] == layers // pp  # the last stage (norm + LM head) never gets extra
    ranges = [layer_range(layers, r, pp) for r in range(pp)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_partition_override_and_its_errors() -> None:
    assert layer_partition(30, 2, "20,10") == [20, 10]
    assert layer_range(30, 1, 2, "20,10") == (20, 30)
    with pytest.raises(ValueError, match=r"VLLM_PP_LAYER_PARTITION.*sums to 29"):
        layer_partition(30, 2, "20,9")
    with pytest.raises(ValueError, match="has 3 entries"):
        layer_partition(30, 2, "10,10,10")
    with pytest.raises(ValueError, match="not a comma-separated"):
        layer_partition(30, 2, "a,b")
    with pytest.raises(ValueError, match="needs >= 1 layer"):
        layer_partition(30, 2, "30,0")


def test_stage_coordinates_are_vllms_layout() -> None:
    # TP innermost: TP=2 x PP=2 -> stage 0 = ranks 0, 1; stage 1 = ranks 2, 3.
    coords = [PipelineStage.of_rank(r, tp_size=2, pp_size=2) for r in range(4)]
    assert [(s.pp_rank, s.tp_rank) for s in coords] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [s.rank for s in coords] == [0, 1, 2, 3]
    assert coords[0].is_first and not coords[0].is_last and coords[3].is_last
    assert coords[2].tp_ranks == [2, 3]
    assert output_rank(tp_size=2, pp_size=2) == 2 and output_rank(1, 1) == 0
    with pytest.raises(ValueError, match="rank: must be in"):
        PipelineStage.of_rank(4, tp_size=2, pp_size=2)


def _specs(names: list[str]) -> dict[str, FullAttentionSpec]:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype="float32")
    return {n: spec for n in names}


def test_pipeline_kv_config_gives_each_stage_its_budget() -> None:
    stage0 = _specs([f"model.layers.{i}.self_attn.attn" for i in range(3)])
    stage1 = _specs([f"model.layers.{i}.self_attn.attn" for i in range(3, 5)])
    budget = 1 << 20
    one_rank = get_kv_cache_config({**stage0, **stage1}, budget)
    config = pipeline_kv_cache_config([stage0, stage1], budget, max_model_len=64)
    # The fuller stage (3 layers) bounds the blocks: budget / (3 x page), not / (5 x page).
    assert config.num_blocks == get_kv_cache_config(stage0, budget).num_blocks
    assert config.num_blocks > one_rank.num_blocks
    assert [g.layer_names for g in config.kv_cache_groups] == [[*stage0, *stage1]]
    mine = stage_kv_cache_config(config, stage1)
    assert [t.shared_by for t in mine.kv_cache_tensors] == [[n] for n in stage1]
    assert mine.num_blocks == config.num_blocks
    assert sum(t.size for t in mine.kv_cache_tensors) <= budget
    assert sum(t.size for t in stage_kv_cache_config(config, stage0).kv_cache_tensors) <= budget
    assert (
        pipeline_kv_cache_config([stage0, stage1], budget, num_gpu_blocks_override=9).num_blocks
        == 9
    )
    with pytest.raises(ValueError, match="held by two stages"):
        pipeline_kv_cache_config([stage0, stage0], budget)


def test_engine_config_refuses_what_pipeline_parallelism_cannot_run(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    model = ModelConfig.from_pretrained(str(tiny_checkpoint("llama")), max_model_len=64)  # 2 layers
    cache = CacheConfig(kv_cache_memory_bytes=1 << 20)
    EngineConfig(model, cache, ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="3 stages for a model of 2 decoder layers"):
        EngineConfig(model, cache, ParallelConfig(pipeline_parallel_size=3))
    with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION"):
        EngineConfig(
            model, cache, ParallelConfig(pipeline_parallel_size=2, pp_layer_partition="2,1")
        )
    with pytest.raises(ValueError, match="'uni' runs one worker"):
        ParallelConfig(pipeline_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="pipeline_parallel_size: must be >= 1"):
        ParallelConfig(pipeline_parallel_size=0)
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2).world_size == 4
    assert ParallelConfig(pipeline_parallel_size=2).executor_backend == "mp"


def test_partition_env_var_reaches_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "20,10")
    assert ParallelConfig(pipeline_parallel_size=2).pp_layer_partition == "20,10"
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    assert ParallelConfig().pp_layer_partition is None
