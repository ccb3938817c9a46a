"""KV cache sizing and allocation on the worker side.

`available_kv_cache_memory` answers "how many bytes may the KV cache use":
on CPU the configured byte budget (there is no free-memory probe worth
trusting), on CUDA `gpu_memory_utilization` of the device minus what the
model and a profiling forward pass at the largest batch already use.

`allocate_kv_caches` turns a `KVCacheConfig` into one tensor per attention
layer, `[2, num_blocks, block_size, num_kv_heads, head_size]` (K then V), in
the order of the model's `kv_cache_specs()`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from paged.kernels.layout import kv_cache_shape
from paged.kvcache import KVCacheConfig
from paged.kvcache.specs import AttentionSpec

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    # --kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2 (kv_cache_dtype.py): 1 byte per value.
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def available_kv_cache_memory(
    device: torch.device,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    profile_run: Callable[[], None],
) -> int:
    """Bytes the KV cache may take on `device` (see the module docstring)."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes
    if device.type != "cuda":
        raise ValueError(
            "kv_cache_memory_bytes: required on CPU (there is no device memory to profile); "
            "set CacheConfig(kv_cache_memory_bytes=...) e.g. 1 << 30 for 1 GiB"
        )
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info(device)
    allocated_before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile_run()
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - allocated_before
    used_before = total - free_before
    budget = int(total * gpu_memory_utilization) - used_before - activation_peak
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves "
            f"no room for the KV cache (model and activations use "
            f"{(used_before + activation_peak) / 2**30:.1f} GiB); raise it or lower "
            "max_num_batched_tokens"
        )
    return budget


def allocate_kv_caches(
    kv_cache_config: KVCacheConfig,
    layer_order: Mapping[str, Any],
    device: torch.device,
) -> list[torch.Tensor]:
    """One zeroed cache tensor per layer, in `layer_order`'s order (zeroed_bytes).

    Each `KVCacheTensor` is one buffer; the layers in its `shared_by` (one per
    KV cache group in hybrid models, e.g. a full-attention and a sliding-window
    layer) view the same memory, each with its own group's spec. Sharing is
    safe because the block pool hands every block to one group at a time.
    """
    spec_of: dict[str, AttentionSpec] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise ValueError(
                f"kv_cache_config: spec {type(spec).__name__} is not an attention spec"
            )
        for name in group.layer_names:
            spec_of[name] = spec
    missing = [name for name in layer_order if name not in spec_of]
    if missing:
        raise ValueError(f"kv_cache_config: layers {missing} have no KV cache group")
    caches: dict[str, torch.Tensor] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        buffer = zeroed_bytes(tensor.size, device)
        for name in tensor.shared_by:
            if name not in spec_of:
                raise ValueError(f"kv_cache_config: tensor shared by unknown layer {name!r}")
            spec = _this_rank_spec(layer_order.get(name), spec_of[name])
            caches[name] = _layer_view(buffer, spec, kv_cache_config.num_blocks, name)
    without = [name for name in layer_order if name not in caches]
    if without:
        raise ValueError(f"kv_cache_config: layers {without} have no KV cache tensor")
    return [caches[name] for name in layer_order]


def zeroed_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed uint8 [nbytes] buffer, 64-byte aligned.

    On CPU from calloc (numpy's zeros): the kernel maps zero pages on first touch,
    so the cache is not written twice (torch.zeros memsets it, then the steps write
    it) and takes memory as blocks fill. torch.zeros of the default ~5 GiB CPU cache
    took 3-10 s of a start-up on this 2-core machine (docs/cpu-startup.md).
    """
    if device.type != "cpu":
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    raw = torch.from_numpy(np.zeros(nbytes + 64, dtype=np.uint8))
    skip = -raw.data_ptr() % 64  # calloc aligns to 16; the kernels' loads like 64
    return raw[skip : skip + nbytes]


def _this_rank_spec(local: Any, group_spec: AttentionSpec) -> AttentionSpec:
    """The spec this rank views a layer's cache with.

    The KV cache config is built from rank 0's specs. With an uneven
    tensor-parallel head split (layers/head_partition.py) a later rank may hold
    fewer KV heads than rank 0; its cache then uses its own head count, in the
    first bytes of each buffer (rank 0 holds the most heads, so it fits).
    Anything else must match the group's spec exactly.
    """
    if (
        isinstance(local, AttentionSpec)
        and type(local) is type(group_spec)
        and local.num_kv_heads < group_spec.num_kv_heads
        and dataclasses.replace(local, num_kv_heads=group_spec.num_kv_heads) == group_spec
    ):
        return local
    return group_spec


def _layer_view(
    buffer: torch.Tensor, spec: AttentionSpec, num_blocks: int, name: str
) -> torch.Tensor:
    """`buffer` seen as one layer's [2, num_blocks, block_size, heads, head_size] cache."""
    dtype = _TORCH_DTYPES.get(spec.dtype)
    if dtype is None:
        raise ValueError(f"kv_cache_config: dtype {spec.dtype!r} is not supported")
    shape = kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > buffer.numel():
        raise ValueError(
            f"kv_cache_config: layer {name!r} needs {nbytes} bytes for {num_blocks} blocks, "
            f"its tensor has {buffer.numel()}"
        )
    return buffer[:nbytes].view(dtype).view(shape)
