"""Argument checks shared by every backend: a clear ``ValueError`` naming the argument.

Both backends call these first, so a bad call fails the same way on CPU and
CUDA instead of crashing deep inside a kernel or writing garbage. Checks here
never read tensor *values* (that would synchronise the GPU); value-level
checks live in the reference implementations only.
"""

from __future__ import annotations

import torch

from paged.kernels.kv_quant import KV_CACHE_DTYPES, check_kv_scale

__all__ = [
    "FLOAT_DTYPES",
    "check_copy_blocks",
    "check_gated",
    "check_paged_attention",
    "check_penalties",
    "check_reshape_and_cache",
    "check_rms_norm",
    "check_rotary",
    "check_same_device",
    "check_top_k_top_p",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_dim(name: str, t: torch.Tensor, dims: int, layout: str) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name} must be {layout}, got shape {_shape(t)}")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_int(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...] = _INT_DTYPES) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} must have dtype in {allowed}, got {t.dtype}")


def _check_cache_dtypes(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Both caches hold one storage dtype: a float dtype or a scaled fp8 one (kv_quant)."""
    if key_cache.dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"key_cache dtype must be one of {KV_CACHE_DTYPES}, got {key_cache.dtype}")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache dtype {value_cache.dtype} must equal key_cache dtype {key_cache.dtype}"
        )


def check_same_device(**tensors: torch.Tensor) -> None:
    """All tensors on one device; the error names each argument's device."""
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        where = ", ".join(f"{n}={t.device}" for n, t in tensors.items())
        raise ValueError(f"tensors must be on one device, got {where}")


def check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    _check_dim("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    if value.shape != key.shape:
        raise ValueError(f"value shape {_shape(value)} must equal key shape {_shape(key)}")
    _check_dim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {_shape(value_cache)} must equal key_cache shape "
            f"{_shape(key_cache)}"
        )
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key [T, Hkv, D] = {_shape(key)} does not match key_cache [N, B, Hkv, D] = "
            f"{_shape(key_cache)}"
        )
    _check_float("key", key)
    if value.dtype != key.dtype:
        raise ValueError(f"value dtype {value.dtype} must equal key dtype {key.dtype}")
    # The cache may store another dtype than the activations (--kv-cache-dtype).
    _check_cache_dtypes(key_cache, value_cache)
    check_kv_scale("k_scale", k_scale)
    check_kv_scale("v_scale", v_scale)
    _check_dim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _check_int("slot_mapping", slot_mapping, (torch.int64,))
    if slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but key has only "
            f"{key.shape[0]} tokens"
        )
    check_same_device(
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slot_mapping,
    )


def check_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None,
    soft_cap: float | None,
    out: torch.Tensor | None,
    bidirectional_ranges: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    _check_dim("query", query, 3, "[num_tokens, num_heads, head_size]")
    if bidirectional_ranges is not None:
        r = bidirectional_ranges
        if r.dim() != 2 or r.shape[1] != 2 or r.shape[0] < query.shape[0]:
            raise ValueError(
                f"bidirectional_ranges must be [num_tokens, 2] (num_tokens={query.shape[0]}), "
                f"got {_shape(r)}"
            )
        if r.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"bidirectional_ranges must be int32 or int64, got {r.dtype}")
        check_same_device(query=query, bidirectional_ranges=r)
    _check_dim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {_shape(value_cache)} must equal key_cache shape "
            f"{_shape(key_cache)}"
        )
    _check_float("query", query)
    # Cached K/V are read back into the query's dtype (kv_quant.dequantize_kv).
    _check_cache_dtypes(key_cache, value_cache)
    check_kv_scale("k_scale", k_scale)
    check_kv_scale("v_scale", v_scale)
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_size:
        raise ValueError(f"key_cache head_size {key_cache.shape[3]} != query head_size {head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    _check_request_metadata(block_table, query_start_loc, seq_lens)
    _check_attention_scalars(scale, max_query_len, max_seq_len, sliding_window, soft_cap)
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(
                f"out must match query ({_shape(query)}, {query.dtype}), "
                f"got ({_shape(out)}, {out.dtype})"
            )
        check_same_device(query=query, out=out)
    check_same_device(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )


def _check_request_metadata(
    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    _check_dim("block_table", block_table, 2, "[num_reqs, max_num_blocks_per_req]")
    _check_int("block_table", block_table)
    _check_dim("query_start_loc", query_start_loc, 1, "[num_reqs + 1]")
    _check_int("query_start_loc", query_start_loc)
    _check_dim("seq_lens", seq_lens, 1, "[num_reqs]")
    _check_int("seq_lens", seq_lens)
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(
            f"query_start_loc must have num_reqs + 1 = {num_reqs + 1} entries, "
            f"got {query_start_loc.shape[0]}"
        )
    if block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table has {block_table.shape[0]} rows but there are {num_reqs} requests"
        )


def _check_attention_scalars(
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None,
    soft_cap: float | None,
) -> None:
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if max_query_len < 0 or max_seq_len < 0:
        raise ValueError(
            f"max_query_len/max_seq_len must be >= 0, got {max_query_len}/{max_seq_len}"
        )
    if max_query_len > max_seq_len:
        raise ValueError(f"max_query_len ({max_query_len}) > max_seq_len ({max_seq_len})")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")


def check_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
) -> None:
    _check_dim("positions", positions, 1, "[num_tokens]")
    _check_int("positions", positions)
    _check_dim("query", query, 2, "[num_tokens, num_heads * head_size]")
    _check_dim("key", key, 2, "[num_tokens, num_kv_heads * head_size]")
    _check_float("query", query)
    if key.dtype != query.dtype:
        raise ValueError(f"key dtype {key.dtype} must equal query dtype {query.dtype}")
    num_tokens = positions.shape[0]
    if query.shape[0] != num_tokens or key.shape[0] != num_tokens:
        raise ValueError(
            f"positions ({num_tokens}), query ({query.shape[0]}) and key ({key.shape[0]}) "
            "must have the same number of tokens"
        )
    if head_size <= 0 or query.shape[1] % head_size or key.shape[1] % head_size:
        raise ValueError(
            f"head_size {head_size} must divide query width {query.shape[1]} and key width "
            f"{key.shape[1]}"
        )
    _check_dim("cos_sin_cache", cos_sin_cache, 2, "[max_position, rotary_dim]")
    _check_float("cos_sin_cache", cos_sin_cache)
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        raise ValueError(
            f"cos_sin_cache rotary_dim {rotary_dim} must be even and in (0, head_size={head_size}]"
        )
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)


def check_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> None:
    _check_dim("x", x, 2, "[num_tokens, hidden_size]")
    _check_float("x", x)
    if weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [hidden_size={x.shape[1]}], got {_shape(weight)}")
    _check_float("weight", weight)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual must match x ({_shape(x)}, {x.dtype}), "
                f"got ({_shape(residual)}, {residual.dtype})"
            )
        check_same_device(x=x, residual=residual)
    check_same_device(x=x, weight=weight)


def check_gated(x: torch.Tensor) -> None:
    _check_dim("x", x, 2, "[num_tokens, 2 * intermediate_size]")
    _check_float("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x last dim must be even (gate and up halves), got {x.shape[1]}")


def _check_per_row(name: str, t: torch.Tensor, batch: int, logits: torch.Tensor) -> None:
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must be [batch={batch}], got {_shape(t)}")
    check_same_device(logits=logits, **{name: t})


def check_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> None:
    _check_dim("logits", logits, 2, "[batch, vocab_size]")
    _check_float("logits", logits)
    if top_k is not None:
        _check_per_row("top_k", top_k, logits.shape[0], logits)
        _check_int("top_k", top_k)
    if top_p is not None:
        _check_per_row("top_p", top_p, logits.shape[0], logits)
        _check_float("top_p", top_p)


def check_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> None:
    _check_dim("logits", logits, 2, "[batch, vocab_size]")
    _check_float("logits", logits)
    if prompt_mask.shape != logits.shape or prompt_mask.dtype != torch.bool:
        raise ValueError(
            f"prompt_mask must be bool {_shape(logits)}, "
            f"got {prompt_mask.dtype} {_shape(prompt_mask)}"
        )
    if output_counts.shape != logits.shape:
        raise ValueError(f"output_counts must be {_shape(logits)}, got {_shape(output_counts)}")
    _check_int("output_counts", output_counts)
    check_same_device(logits=logits, prompt_mask=prompt_mask, output_counts=output_counts)
    for name, t in (("presence", presence), ("frequency", frequency), ("repetition", repetition)):
        _check_per_row(name, t, logits.shape[0], logits)
        _check_float(name, t)


def check_copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor
) -> None:
    if src.dim() < 1 or dst.dim() < 1:
        raise ValueError("src and dst must have a leading block dimension")
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"src block shape {_shape(src)[1:]} must equal dst block shape {_shape(dst)[1:]}"
        )
    if src.dtype != dst.dtype:
        raise ValueError(f"src dtype {src.dtype} must equal dst dtype {dst.dtype}")
    for name, ids in (("src_block_ids", src_block_ids), ("dst_block_ids", dst_block_ids)):
        _check_dim(name, ids, 1, "[num_blocks_to_copy]")
        _check_int(name, ids)
    if src_block_ids.shape != dst_block_ids.shape:
        raise ValueError(
            f"src_block_ids ({src_block_ids.shape[0]}) and dst_block_ids "
            f"({dst_block_ids.shape[0]}) must have the same length"
        )
