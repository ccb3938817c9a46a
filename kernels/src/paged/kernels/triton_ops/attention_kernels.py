"""Triton kernels of paged attention (launched from ``attention.py``).

One launch covers a mixed batch: the grid's first axis walks "query blocks" of
all requests together, second axis the KV heads. A query block is ``BLOCK_Q``
consecutive query tokens of one request times the ``QUERIES_PER_KV`` query heads
sharing one KV head (GQA), i.e. a ``BLOCK_M = BLOCK_Q * QUERIES_PER_KV`` row tile,
so each K/V tile loaded from the cache serves every query head of its group.

Request r's query blocks are numbered from ``query_start_loc[r] // BLOCK_Q + r``
(an upper bound that leaves gaps, found back with a binary search), so the grid
size ``T // BLOCK_Q + R`` needs no host sync.

Rows of the M tile (``m`` in [0, BLOCK_M)):
    query token  = q_block * BLOCK_Q + m // QUERIES_PER_KV
    query head   = kv_head * QUERIES_PER_KV + m % QUERIES_PER_KV

The split-KV variant (``NUM_SEGMENTS > 1``) adds a third grid axis cutting each
request's key range into segments; each writes an unnormalised partial result
with its running max and sum, and ``_reduce_segments_kernel`` merges them.
"""

# @triton.jit functions are untyped (triton ships no types; its JIT reads the
# parameter annotations itself), so these two checks are off in this file only.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_request(query_start_loc_ptr, target, num_reqs, BLOCK_Q: tl.constexpr):
    # Largest r with query_start_loc[r] // BLOCK_Q + r <= target.
    # lo/hi start as int32 tensors: compiled Triton forbids loop-carried
    # variables that begin as constexprs (num_reqs == 1 is specialised to one).
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _key_tiles(
    context_len, seq_len, q_block, segment, sliding_window, range_end,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):  # fmt: skip
    # Key tiles [first, last) that the queries of this q block can see, cut to
    # this program's segment when split-KV is on. range_end: the furthest key a
    # bidirectional span lets one of these queries see (0 without spans).
    last_key = tl.minimum(tl.maximum(context_len + (q_block + 1) * BLOCK_Q, range_end), seq_len)
    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0)
    first_tile = first_key // BLOCK_N
    last_tile = tl.cdiv(last_key, BLOCK_N)
    if NUM_SEGMENTS > 1:
        per_segment = tl.cdiv(last_tile - first_tile, NUM_SEGMENTS)
        first_tile = first_tile + segment * per_segment
        last_tile = tl.minimum(last_tile, first_tile + per_segment)
    return first_tile, last_tile


@triton.jit
def _masked_scores(
    q, k, offs_n, key_valid, q_pos, row_valid, scale, soft_cap, sliding_window,
    range_start, range_end,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, USE_RANGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # [BLOCK_M, BLOCK_N] scaled (and soft-capped) q.k; -inf where causality,
    # the window or padding forbid the pair.
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    if USE_SOFT_CAP:
        # cap * tanh(s / cap); tanh from exp, argument clamped where tanh is +-1 anyway.
        z = tl.minimum(tl.maximum(2.0 * s / soft_cap, -40.0), 40.0)
        s = soft_cap * (1.0 - 2.0 / (tl.exp(z) + 1.0))
    visible = offs_n[None, :] <= q_pos[:, None]
    if USE_RANGES:
        # A query inside a bidirectional span also sees the span's later keys.
        visible = visible | (
            (offs_n[None, :] >= range_start[:, None]) & (offs_n[None, :] < range_end[:, None])
        )
    allowed = key_valid[None, :] & visible & row_valid[:, None]
    if USE_WINDOW:
        allowed = allowed & (q_pos[:, None] - offs_n[None, :] < sliding_window)
    return tl.where(allowed, s, float("-inf"))


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D]                    (NUM_SEGMENTS == 1)
    seg_out_ptr,  # [T, Hq, S, D_PAD] float32  (NUM_SEGMENTS > 1)
    seg_max_ptr,  # [T, Hq, S] float32
    seg_sum_ptr,  # [T, Hq, S] float32
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [N, B, Hkv, D]
    v_cache_ptr,  # [N, B, Hkv, D]
    block_table_ptr,  # [R, M]
    query_start_loc_ptr,  # [R + 1]
    seq_lens_ptr,  # [R]
    ranges_ptr,  # [T, 2] int32 bidirectional spans (USE_RANGES)
    scale,
    k_scale,  # KV_FP8: K = float(cache) * k_scale
    v_scale,
    soft_cap,
    sliding_window,
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_vn,
    stride_vb,
    stride_vh,
    stride_bt,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens)
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per tile
    NUM_SEGMENTS: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_RANGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache holds scaled fp8 (paged.kernels.kv_quant)
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    segment = tl.program_id(2)

    r = _find_request(query_start_loc_ptr, q_block_global, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + r)
    q_len = tl.load(query_start_loc_ptr + r + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + r)
    if q_block * BLOCK_Q >= q_len:
        return

    seq_len = tl.load(seq_lens_ptr + r)
    context_len = seq_len - q_len  # tokens before the first new one

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    token_in_req = q_block * BLOCK_Q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (token_in_req < q_len)
    token = (q_start + token_in_req).to(tl.int64)
    q_pos = context_len + token_in_req  # absolute position of each row's query
    d_mask = offs_d < HEAD_SIZE

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, D_PAD]

    range_start = tl.zeros([BLOCK_M], dtype=tl.int32)
    range_end = tl.zeros([BLOCK_M], dtype=tl.int32)
    if USE_RANGES:
        range_start = tl.load(ranges_ptr + token * 2, mask=row_valid, other=0)
        range_end = tl.load(ranges_ptr + token * 2 + 1, mask=row_valid, other=0)
    first_tile, last_tile = _key_tiles(
        context_len, seq_len, q_block, segment, sliding_window, tl.max(range_end, axis=0),
        BLOCK_Q, BLOCK_N, NUM_SEGMENTS, USE_WINDOW,
    )  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    bt_row = block_table_ptr + r.to(tl.int64) * stride_bt

    for tile in range(first_tile, last_tile):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = offs_n < seq_len
        physical = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        in_block = (offs_n % BLOCK_SIZE).to(tl.int64)
        kv_mask = key_valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr + physical[:, None] * stride_kn + in_block[:, None] * stride_kb
            + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )  # [BLOCK_N, D_PAD]  # fmt: skip
        v = tl.load(
            v_cache_ptr + physical[:, None] * stride_vn + in_block[:, None] * stride_vb
            + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )  # [BLOCK_N, D_PAD]  # fmt: skip
        # The cache may hold another dtype than the query (--kv-cache-dtype):
        # dequantize fp8 tiles, cast float ones; the dots then run in q's dtype.
        if KV_FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        s = _masked_scores(
            q, k, offs_n, key_valid, q_pos, row_valid, scale, soft_cap, sliding_window,
            range_start, range_end, USE_SOFT_CAP, USE_WINDOW, USE_RANGES, DOT_PRECISION,
        )  # [BLOCK_M, BLOCK_N]  # fmt: skip

        # Online softmax; rows that saw no key yet keep m = -inf, guarded below.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )
    else:
        num_heads = tl.num_programs(1) * QUERIES_PER_KV
        row = (token * num_heads + head) * NUM_SEGMENTS + segment  # [BLOCK_M]
        tl.store(seg_out_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.store(seg_max_ptr + row, m_i, mask=row_valid)
        tl.store(seg_sum_ptr + row, l_i, mask=row_valid)


@triton.jit
def _reduce_segments_kernel(
    out_ptr,  # [T, Hq, D]
    seg_out_ptr,  # [T, Hq, S, D_PAD] float32
    seg_max_ptr,  # [T, Hq, S]
    seg_sum_ptr,  # [T, Hq, S]
    query_start_loc_ptr,  # [R + 1]
    num_reqs,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    # One program per (query token, query head): merge segment partials.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return  # padding row: left as allocated (zeros)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, D_PAD)
    row = (token * num_heads + head) * NUM_SEGMENTS + offs_s
    seg_max = tl.load(seg_max_ptr + row)
    seg_sum = tl.load(seg_sum_ptr + row)
    overall = tl.max(seg_max, axis=0)
    overall = tl.where(overall == float("-inf"), 0.0, overall)
    weight = tl.where(seg_max == float("-inf"), 0.0, tl.exp(seg_max - overall))  # [S]
    total = tl.sum(seg_sum * weight, axis=0)
    parts = tl.load(seg_out_ptr + row[:, None] * D_PAD + offs_d[None, :])  # [S, D_PAD]
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )
