"""Turning per-layer specs and a byte budget into a `KVCacheConfig`.

Layers with equal specs form one KV cache group (one manager, one block table
per request). Every group shares one `BlockPool`: block ids are global. Memory
is laid out as `KVCacheTensor`s, each `num_blocks` pages long:

- one spec for all layers: one tensor per layer, all in one group;
- several specs with one page size (hybrid): layers of each spec are split into
  groups of `group_size` layers, and tensor i is shared by the i-th layer of
  every group (a block id used by one group is not used by another at the same
  time, so they can share memory);
- several page sizes: attention specs with a smaller page get a larger block
  size so that every page size equals the largest (this needs the largest to
  be a multiple of each); otherwise `ValueError`. Mamba pages cannot be
  rescaled: pad them with `MambaSpec.page_size_padded`;
- mamba specs in "align" or "all" cache mode then take the attention block size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from paged.kvcache.specs import AttentionSpec, KVCacheSpec, MambaSpec


@dataclass(frozen=True)
class KVCacheTensor:
    """One memory buffer of `size` bytes used by the layers in `shared_by`."""

    size: int
    shared_by: list[str]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers managed together because they share `kv_cache_spec`."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """Blocks (null block included), buffers and groups of an engine's KV cache."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not self.kv_cache_groups:
            raise ValueError("kv_cache_groups must not be empty")


def unify_kv_cache_spec_page_size(
    kv_cache_specs: Mapping[str, KVCacheSpec],
) -> dict[str, KVCacheSpec]:
    """Scale block sizes so that every spec has the largest page size."""
    max_page = max(spec.page_size_bytes for spec in kv_cache_specs.values())
    unified: dict[str, KVCacheSpec] = {}
    for name, spec in kv_cache_specs.items():
        page = spec.page_size_bytes
        if page == max_page:
            unified[name] = spec
            continue
        if isinstance(spec, MambaSpec) or max_page % page != 0:
            raise ValueError(
                f"cannot unify page sizes: layer {name!r} has a page of {page} bytes and "
                f"the largest page is {max_page} bytes (it must be a multiple; pad mamba "
                "layers with page_size_padded)"
            )
        unified[name] = spec.with_block_size(spec.block_size * (max_page // page))
    return unified


def align_mamba_block_size(kv_cache_specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Give caching mamba layers ("align" / "all") the attention block size (vLLM's rule).

    A mamba block is one state, whatever its block size; but prefix hits of a
    hybrid model must end where both kinds of group can resume, and a small
    mamba block size under a large attention block (page sizes unified by
    scaling the attention block) caches states nobody can use. "none" mode
    and models without attention layers are left as they are.
    """
    attn_block_sizes = [
        s.block_size for s in kv_cache_specs.values() if isinstance(s, AttentionSpec)
    ]
    if not attn_block_sizes:
        return dict(kv_cache_specs)
    target = max(attn_block_sizes)
    return {
        name: replace(spec, block_size=target)
        if isinstance(spec, MambaSpec) and spec.mamba_cache_mode != "none"
        else spec
        for name, spec in kv_cache_specs.items()
    }


def _group_layers(kv_cache_specs: Mapping[str, KVCacheSpec]) -> dict[KVCacheSpec, list[str]]:
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_specs.items():
        by_spec.setdefault(spec, []).append(name)
    return by_spec


def get_max_concurrency_for_kv_cache_config(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> float:
    """How many requests of `max_model_len` tokens the cache holds at once (vLLM's formula).

    One request needs, per layer position, the sum over groups of each spec's
    `max_memory_usage_bytes`; blocks hold one page per layer position.
    """
    if max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    groups = kv_cache_config.kv_cache_groups
    num_layers_per_group = max(len(g.layer_names) for g in groups)
    per_request = num_layers_per_group * sum(
        g.kv_cache_spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
        for g in groups
    )
    per_block = groups[0].kv_cache_spec.page_size_bytes * num_layers_per_group
    blocks_per_request = -(-per_request // per_block)
    return kv_cache_config.num_blocks / blocks_per_request


def get_kv_cache_config(
    kv_cache_specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    num_gpu_blocks_override: int | None = None,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> KVCacheConfig:
    """Groups and number of blocks for `kv_cache_specs` within `available_memory` bytes.

    `num_gpu_blocks_override` replaces the computed number of blocks (tests,
    capacity experiments). With `max_model_len`, raises `ValueError` when the
    cache cannot hold even one request of that length (windowed layers count
    their window plus one step of `max_num_batched_tokens` tokens).
    """
    if not kv_cache_specs:
        raise ValueError("kv_cache_specs must contain at least one layer")
    if available_memory < 0:
        raise ValueError(f"available_memory must be >= 0, got {available_memory}")
    specs = dict(kv_cache_specs)
    if len({s.page_size_bytes for s in specs.values()}) > 1:
        specs = unify_kv_cache_spec_page_size(specs)
    specs = align_mamba_block_size(specs)
    by_spec = _group_layers(specs)
    page_size = next(iter(specs.values())).page_size_bytes

    if len(by_spec) == 1:
        spec, layers = next(iter(by_spec.items()))
        groups = [KVCacheGroupSpec(layer_names=list(layers), kv_cache_spec=spec)]
        tensor_layers = [[name] for name in layers]
    else:
        counts = [len(layers) for layers in by_spec.values()]
        # Like vLLM: equal-size groups; pad the smaller types when the counts are
        # close (few wasted slots), else split every type into min-sized groups.
        group_size = max(counts) if max(counts) < min(counts) * 1.25 else min(counts)
        groups = []
        for spec, layers in by_spec.items():
            for i in range(0, len(layers), group_size):
                groups.append(
                    KVCacheGroupSpec(layer_names=layers[i : i + group_size], kv_cache_spec=spec)
                )
        tensor_layers = [
            [g.layer_names[i] for g in groups if i < len(g.layer_names)] for i in range(group_size)
        ]

    num_blocks = available_memory // page_size // len(tensor_layers)
    if num_gpu_blocks_override is not None:
        if num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {num_gpu_blocks_override}")
        num_blocks = num_gpu_blocks_override
    if num_blocks < 2:
        raise ValueError(
            f"available_memory ({available_memory} bytes) holds {num_blocks} blocks of "
            f"{page_size * len(tensor_layers)} bytes; at least 2 are needed (1 is the null block)"
        )
    if max_model_len is not None:

        def blocks_needed(length: int) -> int:
            return 1 + sum(
                -(
                    -g.kv_cache_spec.max_memory_usage_bytes(length, max_num_batched_tokens)
                    // page_size
                )
                for g in groups
            )

        needed = blocks_needed(max_model_len)
        if needed > num_blocks:
            raise ValueError(_too_short_message(num_blocks, needed, max_model_len, blocks_needed))
    tensors = [
        KVCacheTensor(size=page_size * num_blocks, shared_by=names) for names in tensor_layers
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def _too_short_message(
    num_blocks: int, needed: int, max_model_len: int, blocks_needed: Callable[[int], int]
) -> str:
    """vLLM's advice (v1/core/kv_cache_planning.py:67-86): the longest length that fits
    (a binary search, as its estimate_max_model_len) and the options that change it."""
    lo, hi = 0, max_model_len - 1  # the longest fitting length is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_needed(mid) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    fits = f"; the estimated maximum model length is {lo}" if lo > 0 else ""
    return (
        f"{num_blocks} blocks cannot hold one request of max_model_len={max_model_len} "
        f"tokens ({needed} needed){fits}. Give the KV cache more memory (--kv-cache-memory; "
        f"on CPU also VLLM_CPU_KVCACHE_SPACE in GiB; on GPU --gpu-memory-utilization) or "
        f"lower --max-model-len"
    )
