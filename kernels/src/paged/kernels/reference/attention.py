"""Reference paged attention over a mixed prefill + decode batch (pure torch).

Readable definition, not fast: one small dense attention per request.
"""

from __future__ import annotations

import itertools

import torch

from paged.kernels.kv_quant import dequantize_kv
from paged.kernels.validation import check_paged_attention

__all__ = ["gather_request_kv", "paged_attention"]


def gather_request_kv(
    cache: torch.Tensor,  # [N, B, Hkv, D]
    block_table_row: torch.Tensor,  # [M] int
    seq_len: int,
) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request as a dense ``[seq_len, Hkv, D]`` tensor."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    if num_blocks > block_table_row.shape[0]:
        raise ValueError(
            f"seq_len {seq_len} needs {num_blocks} blocks but block_table has "
            f"{block_table_row.shape[0]} columns"
        )
    blocks = block_table_row[:num_blocks].to(torch.int64)
    return cache[blocks].reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def _attend_one(
    q: torch.Tensor,  # [q_len, Hq, D]
    k: torch.Tensor,  # [seq_len, Hkv, D]
    v: torch.Tensor,  # [seq_len, Hkv, D]
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    ranges: torch.Tensor | None = None,  # [q_len, 2] extra keys [start, end) per query
) -> torch.Tensor:
    q_len, num_heads, head_size = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # GQA: query head h reads KV head h // group, i.e. heads split as [Hkv, group].
    q_grouped = q.float().reshape(q_len, num_kv_heads, group, head_size)
    scores = torch.einsum("qkgd,skd->kgqs", q_grouped, k.float()) * scale  # [Hkv, g, q, s]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    # New tokens are the last q_len of the sequence.
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if ranges is not None:
        # Bidirectional spans (e.g. one image's tokens): keys inside the query's
        # span are visible even when they come after it; the window still applies.
        r = ranges.to(device=q.device, dtype=torch.int64)
        allowed |= (k_pos >= r[:, :1]) & (k_pos < r[:, 1:])
    if sliding_window is not None:
        allowed &= q_pos - k_pos < sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("kgqs,skd->qkgd", probs, v.float())
    return out.reshape(q_len, num_heads, head_size)


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
    bidirectional_ranges: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each request's new queries over its cached keys; ``[T, Hq, D]``.

    Request ``r`` owns query rows ``query_start_loc[r]:query_start_loc[r+1]``; they are the
    last ``q_len`` of its ``seq_lens[r]`` tokens, whose K/V are already in the cache. Query
    ``i`` sits at position ``seq_lens[r] - q_len + i`` and sees keys ``0..position`` (only the
    last ``sliding_window`` of them when set). Scores are ``scale * q.k``, then
    ``soft_cap * tanh(s / soft_cap)`` when ``soft_cap`` is set. Rows after
    ``query_start_loc[-1]`` (padding) are zero in a new result, and left untouched when
    ``out`` is given. Computed in float32, returned in query dtype.

    ``bidirectional_ranges`` ``[T, 2]`` int32, when given, widens each query's keys:
    query row ``t`` also sees the keys at positions ``[ranges[t, 0], ranges[t, 1])``
    (still within the sliding window), so the tokens of one span (Gemma3's image)
    attend to each other both ways; ``start == end`` adds nothing. Every span a
    query sits in must be complete in the cache: ``ranges[t, 1] <= seq_len``.

    The caches may hold another dtype than the query: K/V are read back as
    ``float(cache) * k_scale`` / ``* v_scale`` for fp8 caches, a plain cast
    otherwise (``paged.kernels.kv_quant.dequantize_kv``).
    """
    check_paged_attention(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
        max_query_len, max_seq_len, sliding_window, soft_cap, out, bidirectional_ranges,
        k_scale, v_scale,
    )  # fmt: skip
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if starts[0] != 0 or any(b < a for a, b in itertools.pairwise(starts)):
        raise ValueError(f"query_start_loc must start at 0 and be non-decreasing, got {starts}")
    if starts[-1] > query.shape[0]:
        raise ValueError(f"query_start_loc[-1] = {starts[-1]} exceeds num_tokens {query.shape[0]}")
    result = torch.zeros_like(query)
    for r, seq_len in enumerate(lens):
        q_start, q_end = starts[r], starts[r + 1]
        q_len = q_end - q_start
        if q_len > seq_len:
            raise ValueError(f"request {r}: query length {q_len} > seq_len {seq_len}")
        if q_len > max_query_len or seq_len > max_seq_len:
            raise ValueError(
                f"request {r}: q_len {q_len} / seq_len {seq_len} exceed max_query_len "
                f"{max_query_len} / max_seq_len {max_seq_len}"
            )
        if q_len == 0:
            continue
        k = dequantize_kv(gather_request_kv(key_cache, block_table[r], seq_len), torch.float32,
                          k_scale)  # fmt: skip
        v = dequantize_kv(gather_request_kv(value_cache, block_table[r], seq_len), torch.float32,
                          v_scale)  # fmt: skip
        ranges = None
        if bidirectional_ranges is not None:
            ranges = bidirectional_ranges[q_start:q_end]
            if q_len and int(ranges[:, 1].max()) > seq_len:
                raise ValueError(
                    f"request {r}: bidirectional_ranges reach position "
                    f"{int(ranges[:, 1].max())} beyond seq_len {seq_len}: a bidirectional span "
                    "was split across steps (schedule each span whole)"
                )
        attn = _attend_one(query[q_start:q_end], k, v, scale, sliding_window, soft_cap, ranges)
        result[q_start:q_end] = attn.to(query.dtype)
    if out is None:
        return result
    out[: starts[-1]] = result[: starts[-1]]
    return out
