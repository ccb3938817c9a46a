"""Decode attention on CPU in one C call per layer (bf16 KV cache): cache write + attention.

A pure-decode step (one new token per request) on the torch backend with a
bfloat16 cache costs ~40 torch ops per layer through `torch_attention`
(slot checks, two index_copy_, two block gathers, casts to float32, a key
mask, SDPA, reshapes). `paged_decode_attention` in cpu_step/step_ops.c
writes the step's K/V rows and attends each query straight from the paged
blocks in float32, in one call.

What does not change per layer is worked out once per step: `DecodePlan`
holds the step's slot mapping, block table and sequence lengths, checked
for the C call, and is kept for the metadata object it was made from, so
the 29 layers after the first reuse it (hybrid models pass a second
metadata object per KV cache group and get a second plan).
"""

from __future__ import annotations

import torch

from paged.runner.attention.metadata import AttentionMetadata
from paged.runner.cpu_step import ops

# The step's slot mapping, block table and sequence lengths, checked for the C call.
DecodePlan = ops.DecodeStep


# The plans of the latest metadata objects, newest last; a step holds one per
# KV cache group (hybrid models), so a few are kept.
_plans: list[tuple[AttentionMetadata, DecodePlan | None]] = []
_MAX_PLANS = 4


def decode_plan(meta: AttentionMetadata, num_tokens: int) -> DecodePlan | None:
    """The plan for `meta`, or None when the step is not one the C kernel takes.

    It takes a step of R requests with one query each (max_query_len 1, R
    tokens, no padding rows) on CPU with the C library loaded.
    """
    for seen, plan in reversed(_plans):
        if seen is meta:
            return plan
    plan = _make_plan(meta, num_tokens)
    _plans.append((meta, plan))
    del _plans[:-_MAX_PLANS]
    return plan


def _make_plan(meta: AttentionMetadata, num_tokens: int) -> DecodePlan | None:
    num_reqs = meta.num_reqs
    if (
        meta.max_query_len != 1
        or num_reqs == 0
        or num_tokens != num_reqs
        or meta.num_actual_tokens != num_reqs
        or meta.seq_lens.device.type != "cpu"
        or not ops.available()
    ):
        return None
    slot_mapping = meta.slot_mapping[:num_reqs].to(torch.int64).contiguous()
    seq_lens = meta.seq_lens.to(torch.int32).contiguous()
    block_table = meta.block_table.to(torch.int32)
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    if bool((seq_lens < 1).any()):
        return None  # an empty sequence: the torch path's zero rows
    return ops.decode_step(slot_mapping, block_table, seq_lens)


def native_decode_ok(kv_cache: torch.Tensor, query: torch.Tensor) -> bool:
    """The cache and activations are the bf16, contiguous CPU tensors the C kernel reads."""
    return (
        kv_cache.dtype is torch.bfloat16
        and query.dtype is torch.bfloat16
        and kv_cache.device.type == "cpu"
        and kv_cache.is_contiguous()
    )


def decode_attention(
    plan: DecodePlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """query [R, Hq*D], key/value [R, Hkv*D] -> [R, Hq*D]; this step's K/V land in kv_cache."""
    return ops.decode_attention_step(
        plan, query, key, value, kv_cache[0], kv_cache[1], scale, sliding_window, soft_cap
    )
