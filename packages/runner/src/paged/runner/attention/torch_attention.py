"""Batched pure-torch paged attention: the `torch` backend's fast path.

paged.kernels.reference is the readable definition (one dense attention per
request, checks on every call). This module computes the same thing with
fewer, larger ops, which is what makes the CPU backend usable:

    decode rows (q_len == 1): gather every request's K/V through its block
        table at once -> [R, S, Hkv, D], one SDPA call with a key mask
        (key < seq_len, and inside the sliding window). With a sliding
        window shorter than the context, only the blocks that hold each
        request's window are gathered (the scheduler may already have freed
        and reused the older ones).
    prefill/chunk rows (q_len > 1): one SDPA call per such request (few per
        step; batching them would pad every chunk to the longest one).

Soft-capping is not expressible with SDPA; with soft_cap set, the reference
kernel runs instead. Results match the reference to float rounding (tested).

A cache of another dtype than the activations (--kv-cache-dtype) is gathered
as stored (an fp8 gather moves a quarter of float32's bytes) and converted
after the gather: fp8 times its per-tensor scale, float dtypes cast
(paged.kernels.kv_quant). This is the CPU path for fp8 caches: the C
attention kernel (cpu_decode) reads bfloat16 caches only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged.kernels import reference
from paged.kernels.kv_quant import dequantize_kv, is_fp8, quantize_kv


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Same contract as paged.kernels.reference.reshape_and_cache (slots -1 skipped)."""
    n = slot_mapping.shape[0]
    key, value = key[:n], value[:n]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    stored_k = quantize_kv(key, flat_k.dtype, k_scale)
    stored_v = quantize_kv(value, flat_v.dtype, v_scale)
    if is_fp8(flat_k.dtype):
        # torch has no CPU index_copy_ for fp8 dtypes; the bytes are what move.
        flat_k, stored_k = flat_k.view(torch.uint8), stored_k.view(torch.uint8)
        flat_v, stored_v = flat_v.view(torch.uint8), stored_v.view(torch.uint8)
    flat_k.index_copy_(0, slot_mapping, stored_k)
    flat_v.index_copy_(0, slot_mapping, stored_v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[R, M, B, Hkv, D] via the block table -> [R, Hkv, num_keys, D]."""
    block_size = cache.shape[1]
    blocks = -(-num_keys // block_size)
    # index_select on the flattened ids is about twice as fast on CPU as
    # advanced indexing with the 2-D id tensor, and gathers the same rows.
    ids = block_table[:, :blocks].reshape(-1)
    kv = cache.index_select(0, ids)  # [R * blocks, B, Hkv, D]
    kv = kv.view(block_table.shape[0], blocks * block_size, *cache.shape[2:])[:, :num_keys]
    return kv.transpose(1, 2)


# One decode-step mask serves every layer of a step with the same window and
# key count. The masks of the latest seq_lens are kept and matched by value (a
# copy is compared, not the tensor's identity, which callers may reuse and
# refill); hybrid models (full and sliding layers) need one per window.
_decode_masks: list[tuple[torch.Tensor, int, int | None, torch.Tensor]] = []
_MAX_DECODE_MASKS = 4


def _decode_key_mask(
    seq_lens: torch.Tensor, num_keys: int, sliding_window: int | None
) -> torch.Tensor:
    """_key_mask for one decode query per request (query position seq_len - 1), cached."""
    same_step = bool(_decode_masks) and _same_values(_decode_masks[-1][0], seq_lens)
    if same_step:
        for _, keys, window, mask in _decode_masks:
            if keys == num_keys and window == sliding_window:
                return mask
    else:
        _decode_masks.clear()  # a new step: the old masks are dead
    seq = seq_lens.long()
    mask = _key_mask(seq, (seq - 1)[:, None], num_keys, sliding_window)
    _decode_masks.append((seq_lens.clone(), num_keys, sliding_window, mask))
    del _decode_masks[:-_MAX_DECODE_MASKS]
    return mask


def _window_blocks(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids [R, W] covering each decode query's window, and its key mask [R, 1, 1, W*B].

    The query sits at position seq_len - 1 and sees keys k with
    seq_len - window <= k < seq_len: at most ceil(window / B) + 1 blocks from
    the one holding seq_len - window. Columns past the table's width (short
    requests) repeat its last entry; their positions are >= seq_len, masked.
    """
    seq = seq_lens.long()
    first_block = (seq - window).clamp(min=0) // block_size  # [R]
    num_blocks = -(-window // block_size) + 1
    cols = first_block[:, None] + torch.arange(num_blocks, device=seq.device)
    ids = block_table.gather(1, cols.clamp(max=block_table.shape[1] - 1))
    k_pos = first_block[:, None] * block_size + torch.arange(
        num_blocks * block_size, device=seq.device
    )
    allowed = (k_pos < seq[:, None]) & (k_pos >= (seq - window)[:, None])
    return ids, allowed[:, None, None, :]


def _gather_ids(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N, B, Hkv, D] rows `ids` [R, W] -> [R, Hkv, W*B, D]."""
    kv = cache.index_select(0, ids.reshape(-1))  # [R * W, B, Hkv, D]
    return kv.view(ids.shape[0], -1, *cache.shape[2:]).transpose(1, 2)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.device == b.device and torch.equal(a, b)


def _key_mask(
    seq_lens: torch.Tensor,
    q_pos: torch.Tensor,
    num_keys: int,
    sliding_window: int | None,
    key_start: int = 0,
    ranges: torch.Tensor | None = None,
) -> torch.Tensor:
    """Allowed keys: bool [R, 1, Q, S] from per-row query positions q_pos [R, Q].

    The S keys are positions key_start .. key_start + S - 1. ranges [Q, 2]
    (one request's rows): each query also sees keys in [start, end) (a
    bidirectional span), still inside the sliding window.
    """
    k_pos = torch.arange(key_start, key_start + num_keys, device=seq_lens.device)
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]
    if ranges is not None:
        inside = (k_pos[None, :] >= ranges[:, :1]) & (k_pos[None, :] < ranges[:, 1:])
        allowed = allowed | inside[None]
    allowed &= k_pos[None, None, :] < seq_lens[:, None, None]
    if sliding_window is not None:
        allowed &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window
    return allowed[:, None]


def _decode_dtype(q: torch.Tensor) -> torch.dtype:
    """float32 for bfloat16 decode queries on CPU: SDPA's one-query path measured 2.3x
    faster there in float32 than in bfloat16 (SmolLM2, 128-token decode), and softmax
    accumulates in float32 either way."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        return torch.float32
    return q.dtype


def _decode_sdpa(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per request: [R, Hq, D] against k/v [R, Hkv, S, D] -> [R, Hq, D].

    The G = Hq / Hkv query heads sharing a KV head go in as G query rows of
    that head ([R, Hkv, G, D]; heads are KV-major, as enable_gqa maps them),
    so SDPA walks R x Hkv (query, key) pairs instead of R x Hq with each KV
    head's keys re-read G times: the same scores and softmax per row, measured
    ~20% faster for 32 requests (SmolLM2, 9 query / 3 KV heads, CPU). The mask
    [R, 1, 1, S] broadcasts over heads and rows.
    """
    r, hq, d = query.shape
    hkv = k.shape[1]
    cdt = _decode_dtype(query)
    q = query.reshape(r, hkv, hq // hkv, d).to(cdt)
    o = F.scaled_dot_product_attention(q, k.to(cdt), v.to(cdt), attn_mask=mask, scale=scale)
    return o.reshape(r, hq, d).to(query.dtype)


def paged_attention(
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
    bidirectional_ranges: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Same contract as paged.kernels.reference.paged_attention.

    bidirectional_ranges only changes prefill/chunk rows: a one-token query's
    span, if complete in the cache (the contract), ends right after it, so it
    adds no key that causality did not already allow.
    """
    if soft_cap is not None:
        return reference.paged_attention(
            query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
            sliding_window=sliding_window, soft_cap=soft_cap, out=out,
            bidirectional_ranges=bidirectional_ranges, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    if out is None:
        out = torch.zeros_like(query)
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_seq_len == 0:
        return out
    if max_query_len == 1 and query.shape[0] == num_reqs:
        # Pure decode: q_len <= 1 per request and R queries in all (the query
        # rows are query_start_loc[R] tokens), so every request has exactly
        # one, in request order; no row bookkeeping needed.
        block_size = key_cache.shape[1]
        if sliding_window is not None and max_seq_len >= sliding_window + block_size:
            ids, mask = _window_blocks(block_table, seq_lens, block_size, sliding_window)
            k = _gather_ids(key_cache, ids)
            v = _gather_ids(value_cache, ids)
        else:
            k = _gather(key_cache, block_table, max_seq_len)
            v = _gather(value_cache, block_table, max_seq_len)
            mask = _decode_key_mask(seq_lens, max_seq_len, sliding_window)
        cdt = _decode_dtype(query)
        k, v = dequantize_kv(k, cdt, k_scale), dequantize_kv(v, cdt, v_scale)
        out[:num_reqs] = _decode_sdpa(query, k, v, mask, scale)
        return out
    seq = seq_lens.long()
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    is_decode = q_lens == 1
    decode = is_decode.nonzero().flatten()
    prefill: list[int] = []
    if max_query_len > 1:
        prefill = (~is_decode & (q_lens > 0)).nonzero().flatten().tolist()
    if decode.numel():
        rows = starts[decode]
        block_size = key_cache.shape[1]
        if sliding_window is not None and max_seq_len >= sliding_window + block_size:
            ids, mask = _window_blocks(
                block_table[decode], seq_lens[decode], block_size, sliding_window
            )
            k = _gather_ids(key_cache, ids)
            v = _gather_ids(value_cache, ids)
        else:
            k = _gather(key_cache, block_table[decode], max_seq_len)
            v = _gather(value_cache, block_table[decode], max_seq_len)
            mask = _key_mask(seq[decode], (seq[decode] - 1)[:, None], max_seq_len, sliding_window)
        cdt = _decode_dtype(query)
        k, v = dequantize_kv(k, cdt, k_scale), dequantize_kv(v, cdt, v_scale)
        out[rows] = _decode_sdpa(query[rows], k, v, mask, scale)
    for r in prefill:
        start, q_len, seq_len = int(starts[r]), int(q_lens[r]), int(seq[r])
        q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        # With a window, skip the blocks before the first query's window (the
        # scheduler may have freed and reused them).
        first_block = 0
        if sliding_window is not None:
            first_block = max(0, seq_len - q_len - sliding_window + 1) // key_cache.shape[1]
        key_start = first_block * key_cache.shape[1]
        table = block_table[r : r + 1, first_block:]
        k = dequantize_kv(_gather(key_cache, table, seq_len - key_start), q.dtype, k_scale)
        v = dequantize_kv(_gather(value_cache, table, seq_len - key_start), q.dtype, v_scale)
        ranges = None
        if bidirectional_ranges is not None:
            ranges = bidirectional_ranges[start : start + q_len].long()
            if not bool((ranges[:, 1] > ranges[:, 0]).any()):
                ranges = None  # no span in this request's chunk: plain causal
        if q_len == seq_len and sliding_window is None and ranges is None:
            # A whole prompt at once: plain causal attention. SDPA's is_causal
            # skips the masked half instead of materialising a [q, q] mask.
            o = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[None]
            mask = _key_mask(
                seq[r : r + 1], q_pos, seq_len - key_start, sliding_window, key_start, ranges
            )
            o = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start : start + q_len] = o[0].transpose(0, 1).to(out.dtype)
    return out
