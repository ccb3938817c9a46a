"""Triton paged attention: public wrappers, launch configuration, split-KV choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from paged.kernels.kv_quant import is_fp8
from paged.kernels.triton_ops._common import (
    check_last_dim_contiguous,
    check_triton_device,
    interpreting,
    next_power_of_2,
)
from paged.kernels.triton_ops.attention_kernels import (
    _paged_attention_kernel,
    _reduce_segments_kernel,
)
from paged.kernels.validation import check_paged_attention

__all__ = ["AttentionLaunch", "choose_launch", "paged_attention", "paged_attention_split_kv"]

_MAX_SEGMENTS = 16


@dataclass(frozen=True, slots=True)
class AttentionLaunch:
    """Tile sizes of one paged-attention launch (see ``attention_kernels`` for the tiling)."""

    block_m: int  # query rows per program (tokens x heads of one KV group)
    block_q: int  # query tokens per program = block_m // queries_per_kv
    block_n: int  # keys per inner-loop tile
    num_segments: int  # > 1: split-KV (flash-decoding) with a reduce pass
    num_warps: int


def choose_launch(
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    max_query_len: int,
    max_seq_len: int,
    num_tokens: int,
    num_reqs: int,
    device: torch.device,
    num_segments: int | None = None,
) -> AttentionLaunch:
    """Pick tiles: 16-row tiles for decode-heavy batches, 64 for prefill; split-KV for
    decode-only batches whose (request x KV head) programs would not fill the GPU.

    Not tuned on a GPU. The sizes keep every configuration free of register spills
    when compiled for sm_90 (checked offline with Triton's compiler and cuobjdump):
    float32 tiles are halved because 64x64 float32 tiles spill.
    """
    qpkv = num_heads // num_kv_heads
    d_pad = max(16, next_power_of_2(head_size))
    wide = dtype == torch.float32
    rows = 64 if max_query_len * qpkv >= 64 and not (wide and d_pad > 128) else 16
    block_m = max(rows, next_power_of_2(qpkv))  # tl.dot needs >= 16 rows
    block_q = block_m // qpkv
    block_n = 64 if d_pad <= 128 and not wide else 32
    num_warps = 8 if block_m >= 64 else 4
    if num_segments is None:
        num_segments = 1
        if max_query_len <= 1 and device.type == "cuda" and not interpreting():
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            programs = max(1, (num_tokens // block_q + num_reqs) * num_kv_heads)
            tiles = triton.cdiv(max(max_seq_len, 1), block_n)
            want = triton.cdiv(2 * sms, programs)
            num_segments = min(next_power_of_2(want), _MAX_SEGMENTS, next_power_of_2(tiles))
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two >= 1, got {num_segments}")
    return AttentionLaunch(block_m, block_q, block_n, num_segments, num_warps)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [N, B, Hkv, D]
    value_cache: torch.Tensor,  # [N, B, Hkv, D]
    block_table: torch.Tensor,  # [R, M] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    bidirectional_ranges: torch.Tensor | None = None,  # [T, 2] int32
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Same contract as ``paged.kernels.reference.paged_attention``, in one launch.

    Decode-only batches on a GPU may take the split-KV path automatically. Request
    metadata values are not read on the host (no sync): ``query_start_loc``,
    ``seq_lens`` and ``block_table`` must be consistent (the reference checks them).
    """
    return paged_attention_split_kv(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
        max_query_len=max_query_len, max_seq_len=max_seq_len, sliding_window=sliding_window,
        soft_cap=soft_cap, out=out, num_segments=None,
        bidirectional_ranges=bidirectional_ranges, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def paged_attention_split_kv(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    num_segments: int | None = None,
    bidirectional_ranges: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """``paged_attention`` with an explicit split-KV segment count (None = automatic).

    ``num_segments > 1`` splits every request's key range into that many segments
    (flash-decoding) and merges them in a second kernel; any batch is allowed, it
    pays off for long decode contexts with few requests.
    """
    check_paged_attention(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
        max_query_len, max_seq_len, sliding_window, soft_cap, out, bidirectional_ranges,
        k_scale, v_scale,
    )  # fmt: skip
    check_triton_device(query=query, key_cache=key_cache, block_table=block_table)
    use_ranges = bidirectional_ranges is not None
    # Unused pointer when there are no ranges (USE_RANGES=False never reads it).
    ranges = seq_lens
    if bidirectional_ranges is not None:
        ranges = bidirectional_ranges.to(torch.int32).contiguous()
    check_last_dim_contiguous(query=query, key_cache=key_cache, value_cache=value_cache)
    if out is not None:
        check_last_dim_contiguous(out=out)
    result = torch.zeros_like(query) if out is None else out
    num_tokens, num_heads, head_size = query.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return result
    num_kv_heads = key_cache.shape[2]
    launch = choose_launch(
        num_heads, num_kv_heads, head_size, query.dtype, max_query_len, max_seq_len,
        num_tokens, num_reqs, query.device, num_segments,
    )  # fmt: skip
    d_pad = max(16, next_power_of_2(head_size))
    segs = launch.num_segments
    seg_shape = (num_tokens, num_heads, segs) if segs > 1 else (1,)
    seg_out = torch.empty(*seg_shape, d_pad if segs > 1 else 1, dtype=torch.float32,
                          device=query.device)  # fmt: skip
    seg_max = torch.empty(seg_shape, dtype=torch.float32, device=query.device)
    seg_sum = torch.empty(seg_shape, dtype=torch.float32, device=query.device)
    grid = (num_tokens // launch.block_q + num_reqs, num_kv_heads, segs)
    _paged_attention_kernel[grid](
        result, seg_out, seg_max, seg_sum, query, key_cache, value_cache, block_table,
        query_start_loc, seq_lens, ranges, scale, float(k_scale), float(v_scale),
        float(soft_cap or 0.0),
        int(sliding_window or 0), num_reqs,
        query.stride(0), query.stride(1), result.stride(0), result.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        HEAD_SIZE=head_size, D_PAD=d_pad, QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_M=launch.block_m, BLOCK_Q=launch.block_q,
        BLOCK_N=launch.block_n, NUM_SEGMENTS=segs, USE_SOFT_CAP=soft_cap is not None,
        USE_WINDOW=sliding_window is not None, USE_RANGES=use_ranges,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_FP8=is_fp8(key_cache.dtype),
        num_warps=launch.num_warps,
    )  # fmt: skip
    if segs > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            result, seg_out, seg_max, seg_sum, query_start_loc, num_reqs, num_heads,
            result.stride(0), result.stride(1),
            HEAD_SIZE=head_size, D_PAD=d_pad, NUM_SEGMENTS=segs,
        )  # fmt: skip
    return result
