"""KV cache sizing and allocation when each pipeline stage holds some of the layers.

The scheduler sees one `KVCacheConfig` over every layer of the model (the
union of the stages' specs): one block id means the same block on every
stage. Each stage allocates only its own layers' tensors, so its memory
holds `budget / bytes-per-block-of-its-layers` blocks; the engine takes the
smallest of those over the stages (vLLM: the minimum over workers), which is
PP times more blocks than one rank holding every layer would get.

    engine:  pipeline_kv_cache_config([specs of stage 0, specs of stage 1], budget)
    stage s: stage_kv_cache_config(engine config, stage s's layer names)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from paged.kvcache import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    get_kv_cache_config,
)


def pipeline_kv_cache_config(
    stage_specs: Sequence[Mapping[str, KVCacheSpec]],
    available_memory: int,
    *,
    num_gpu_blocks_override: int | None = None,
    max_model_len: int | None = None,
) -> KVCacheConfig:
    """The engine-wide config: union of the stages' layers, blocks = min over the stages.

    `available_memory` is one stage's budget (vLLM's kv_cache_memory_bytes is per device).
    """
    if not stage_specs or any(not specs for specs in stage_specs):
        raise ValueError("stage_specs: every pipeline stage must report KV cache layers")
    union: dict[str, KVCacheSpec] = {}
    for specs in stage_specs:
        overlap = set(union) & set(specs)
        if overlap:
            raise ValueError(f"stage_specs: layers {sorted(overlap)} are held by two stages")
        union.update(specs)
    blocks = num_gpu_blocks_override
    if blocks is None:
        blocks = min(
            get_kv_cache_config(specs, available_memory).num_blocks for specs in stage_specs
        )
    return get_kv_cache_config(
        union, available_memory, num_gpu_blocks_override=blocks, max_model_len=max_model_len
    )


def stage_kv_cache_config(config: KVCacheConfig, layer_names: Iterable[str]) -> KVCacheConfig:
    """`config` restricted to this stage's layers: only their tensors; every group kept.

    Groups stay (with only this stage's layers, possibly none) so that block
    tables line up with the scheduler's per-group block ids.
    """
    mine = set(layer_names)
    tensors = [
        KVCacheTensor(size=t.size, shared_by=[n for n in t.shared_by if n in mine])
        for t in config.kv_cache_tensors
        if any(n in mine for n in t.shared_by)
    ]
    groups = [
        KVCacheGroupSpec(
            layer_names=[n for n in g.layer_names if n in mine], kv_cache_spec=g.kv_cache_spec
        )
        for g in config.kv_cache_groups
    ]
    return KVCacheConfig(
        num_blocks=config.num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )
