"""Attention on CPU in one C call per layer for every causal query run (bf16 KV cache).

Every request of a step -- decode rows (one new token), speculative-verification
rows (the bonus position plus the drafts) and prefill chunks (up to the step's
token budget) -- goes through `paged_attention_rows` in cpu_step/attention.c: the
step's K/V rows are written to their slots and every query row attends straight
from the paged blocks, causally within its request, in float32. The same code
path serves one-row and multi-row requests, so a verification row gives the bits
a plain decode row at that position gives (greedy speculation then equals plain
greedy decoding on the bf16 path too), and a prefill row gives them as well.

Prefill chunks used to go through torch SDPA (bfloat16 on CPU); the C call
measured 2.2x faster on them (one layer of SmolLM2, 1 thread: a 512-row request
over 512 keys 4.1 vs 8.9 ms, eight 256-row requests 8.0 vs 18.4 ms) and is
float32 inside, so it takes them too. Only a step with bidirectional image spans
keeps SDPA for its multi-row requests (the C call is causal only): its one-row
requests still go through the C call -- so a decode row gives the same bits
whatever else its step holds -- and the rest through the torch path (`SplitPlan`).

What does not change per layer is worked out once per step: `DecodePlan`
holds the step's slot mapping, block table, query starts and sequence lengths,
checked for the C call, and is kept for the metadata object it was made from,
so the 29 layers after the first reuse it (hybrid models pass a second
metadata object per KV cache group and get a second plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged.runner.attention import torch_attention
from paged.runner.attention.metadata import AttentionMetadata
from paged.runner.cpu_step import attention_ops

# The step's layout, checked for the C call.
DecodePlan = attention_ops.RowsStep


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """A step with image spans: its one-row requests go to the C call, the rest to SDPA."""

    short: DecodePlan  # the one-row requests, as their own step
    short_rows: torch.Tensor  # [T_short] int64: their token rows in the step
    long_rows: torch.Tensor  # [T_long] int64: the other requests' token rows
    long_meta: AttentionMetadata  # the other requests, as their own step (torch path)

    @property
    def max_query_len(self) -> int:
        return self.short.max_query_len


Plan = DecodePlan | SplitPlan

# The plans of the latest metadata objects, newest last; a step holds one per
# KV cache group (hybrid models), so a few are kept.
_plans: list[tuple[AttentionMetadata, Plan | None]] = []
_MAX_PLANS = 4


def decode_plan(meta: AttentionMetadata, num_tokens: int) -> Plan | None:
    """The plan for `meta`, or None when no request of the step is one the C call takes.

    A request is taken when it has at least one query row (with bidirectional
    image spans in the step, exactly one); the step must have no
    padding rows, a CPU layout and the C library loaded. All requests taken: a
    `DecodePlan`; some: a `SplitPlan`.
    """
    for seen, plan in reversed(_plans):
        if seen is meta:
            return plan
    plan = _make_plan(meta, num_tokens)
    _plans.append((meta, plan))
    del _plans[:-_MAX_PLANS]
    return plan


def _make_plan(meta: AttentionMetadata, num_tokens: int) -> Plan | None:
    num_reqs = meta.num_reqs
    if (
        num_reqs == 0
        or meta.max_query_len < 1
        or num_tokens != meta.num_actual_tokens
        or meta.seq_lens.device.type != "cpu"
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
    short = q_lens >= 1
    if meta.bidirectional_ranges is not None:
        short &= q_lens <= 1
    block_table = meta.block_table.to(torch.int32)
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    slot_mapping = meta.slot_mapping[:num_tokens].to(torch.int64).contiguous()
    if bool(short.all()):
        return attention_ops.rows_step(slot_mapping, block_table, query_start_loc, seq_lens)
    if not bool(short.any()):
        return None
    return _split(meta, short, q_lens, query_start_loc, seq_lens, block_table, slot_mapping)


def _split(
    meta: AttentionMetadata, short: torch.Tensor, q_lens: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> SplitPlan:  # fmt: skip
    """The step's requests in two sub-steps: one-row runs (C) and the rest (torch)."""
    token_short = torch.repeat_interleave(short, q_lens.long())  # [T] bool
    short_rows = token_short.nonzero().flatten()
    long_rows = (~token_short).nonzero().flatten()

    def starts(mask: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(int(mask.sum()) + 1, dtype=torch.int32)
        out[1:] = torch.cumsum(q_lens[mask], 0)
        return out

    long_req = ~short
    ranges = meta.bidirectional_ranges
    long_meta = AttentionMetadata(
        num_actual_tokens=int(long_rows.shape[0]),
        query_start_loc=starts(long_req),
        seq_lens=seq_lens[long_req],
        block_table=block_table[long_req],
        slot_mapping=slot_mapping[long_rows],
        max_query_len=int(q_lens[long_req].max()),
        max_seq_len=int(seq_lens[long_req].max()),
        bidirectional_ranges=None if ranges is None else ranges[long_rows],
    )
    short_step = attention_ops.rows_step(
        slot_mapping[short_rows].contiguous(), block_table[short].contiguous(),
        starts(short), seq_lens[short].contiguous(),
    )  # fmt: skip
    return SplitPlan(short_step, short_rows, long_rows, long_meta)


def native_decode_ok(kv_cache: torch.Tensor, query: torch.Tensor) -> bool:
    """The cache and activations are the bf16, contiguous CPU tensors the C kernel reads."""
    return (
        kv_cache.dtype is torch.bfloat16
        and query.dtype is torch.bfloat16
        and kv_cache.device.type == "cpu"
        and kv_cache.is_contiguous()
    )


def decode_attention(
    plan: Plan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> torch.Tensor:
    """query [T, Hq*D], key/value [T, Hkv*D] -> [T, Hq*D]; this step's K/V land in kv_cache."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if isinstance(plan, attention_ops.RowsStep):
        return attention_ops.attention_rows_step(
            plan, query, key, value, key_cache, value_cache, scale, sliding_window, soft_cap
        )
    out = torch.empty(query.shape, dtype=query.dtype)
    rows = plan.short_rows
    out[rows] = attention_ops.attention_rows_step(
        plan.short, query[rows], key[rows], value[rows], key_cache, value_cache,
        scale, sliding_window, soft_cap,
    )  # fmt: skip
    rows, meta = plan.long_rows, plan.long_meta
    _, _, hkv, d = key_cache.shape
    n, hq = rows.shape[0], query.shape[1] // d
    torch_attention.reshape_and_cache(
        key[rows].view(n, hkv, d), value[rows].view(n, hkv, d), key_cache, value_cache,
        meta.slot_mapping,
    )  # fmt: skip
    long_out = torch_attention.paged_attention(
        query[rows].view(n, hq, d), key_cache, value_cache, meta.block_table,
        meta.query_start_loc, meta.seq_lens, scale,
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
        sliding_window=sliding_window, soft_cap=soft_cap,
        bidirectional_ranges=meta.bidirectional_ranges,
    )  # fmt: skip
    out[rows] = long_out.reshape(n, hq * d)
    return out
