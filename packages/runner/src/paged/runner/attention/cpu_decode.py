"""Attention on CPU in one C call per layer for steps of short query runs (bf16 KV cache).

A step whose requests all have short query runs -- decode rows (one new token)
and speculative-verification rows (the bonus position plus the drafts, at most
`MAX_QUERY_ROWS` per request), no prefill chunk -- goes through
`paged_attention_rows` in cpu_step/attention.c: the step's K/V rows are written
to their slots and every query row attends straight from the paged blocks,
causally within its request, in float32. The same code path serves one-row and
multi-row requests, so a verification row gives the bits a plain decode row at
that position gives (greedy speculation then equals plain greedy decoding on the
bf16 path too). Steps with a prefill chunk keep the torch SDPA path.

What does not change per layer is worked out once per step: `DecodePlan`
holds the step's slot mapping, block table, query starts and sequence lengths,
checked for the C call, and is kept for the metadata object it was made from,
so the 29 layers after the first reuse it (hybrid models pass a second
metadata object per KV cache group and get a second plan).
"""

from __future__ import annotations

import torch

from paged.runner.attention.metadata import AttentionMetadata
from paged.runner.cpu_step import attention_ops

# The step's layout, checked for the C call.
DecodePlan = attention_ops.RowsStep

# Longest query run per request the C call takes. Verification rows are
# 1 + num_speculative_tokens (<= 16 in practice); a longer run is a prefill
# chunk, where SDPA's blocked matmuls win over per-row scoring.
MAX_QUERY_ROWS = 16


# The plans of the latest metadata objects, newest last; a step holds one per
# KV cache group (hybrid models), so a few are kept.
_plans: list[tuple[AttentionMetadata, DecodePlan | None]] = []
_MAX_PLANS = 4


def decode_plan(meta: AttentionMetadata, num_tokens: int) -> DecodePlan | None:
    """The plan for `meta`, or None when the step is not one the C kernel takes.

    It takes a step of R requests with 1..MAX_QUERY_ROWS query rows each (no
    padding rows, no bidirectional spans over several rows) on CPU with the C
    library loaded.
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
        not 1 <= meta.max_query_len <= MAX_QUERY_ROWS
        or num_reqs == 0
        or num_tokens != meta.num_actual_tokens
        or meta.seq_lens.device.type != "cpu"
        or (meta.bidirectional_ranges is not None and meta.max_query_len > 1)
        or not attention_ops.available()
    ):
        return None
    query_start_loc = meta.query_start_loc[: num_reqs + 1].to(torch.int32).contiguous()
    if int(query_start_loc[-1]) != num_tokens:
        return None
    seq_lens = meta.seq_lens.to(torch.int32).contiguous()
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if bool((seq_lens < 1).any()) or bool((q_lens > seq_lens).any()):
        return None  # an empty sequence: the torch path's zero rows
    slot_mapping = meta.slot_mapping[:num_tokens].to(torch.int64).contiguous()
    block_table = meta.block_table.to(torch.int32)
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    return attention_ops.rows_step(slot_mapping, block_table, query_start_loc, seq_lens)


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
    """query [T, Hq*D], key/value [T, Hkv*D] -> [T, Hq*D]; this step's K/V land in kv_cache."""
    return attention_ops.attention_rows_step(
        plan, query, key, value, kv_cache[0], kv_cache[1], scale, sliding_window, soft_cap
    )
