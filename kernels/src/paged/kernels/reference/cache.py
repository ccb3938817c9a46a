"""Reference cache writes and block copies (pure torch, any device)."""

from __future__ import annotations

import torch

from paged.kernels.kv_quant import is_fp8, quantize_kv
from paged.kernels.layout import PAD_SLOT_ID
from paged.kernels.validation import check_copy_blocks, check_reshape_and_cache

__all__ = ["copy_blocks", "reshape_and_cache"]


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [N, B, Hkv, D]
    value_cache: torch.Tensor,  # [N, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T'] int64, T' <= T; slot = block * B + offset, -1 = skip
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token ``t``'s K/V to ``cache[slot // B, slot % B]``; slots ``== -1`` are skipped.

    Only the first ``len(slot_mapping)`` tokens are written (``key`` may carry
    padding rows beyond them, e.g. for CUDA graphs). A cache of another dtype
    gets the values cast; an fp8 cache gets ``x / scale`` saturated to the
    format's range (``paged.kernels.kv_quant.quantize_kv``).
    """
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    num_tokens = slot_mapping.shape[0]
    valid = slot_mapping != PAD_SLOT_ID
    slots = slot_mapping[valid]
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_blocks * block_size):
        raise ValueError(
            f"slot_mapping values must be -1 or in [0, {num_blocks * block_size}), "
            f"got range [{int(slots.min())}, {int(slots.max())}]"
        )
    block_ids = slots // block_size
    offsets = slots % block_size
    key_cache[block_ids, offsets] = quantize_kv(key[:num_tokens][valid], key_cache.dtype, k_scale)
    value_cache[block_ids, offsets] = quantize_kv(
        value[:num_tokens][valid], value_cache.dtype, v_scale
    )


def copy_blocks(
    src: torch.Tensor,  # [N, *block_shape]
    dst: torch.Tensor,  # [N2, *block_shape]
    src_block_ids: torch.Tensor,  # [K] int
    dst_block_ids: torch.Tensor,  # [K] int
) -> None:
    """``dst[dst_block_ids[i]] = src[src_block_ids[i]]`` for every ``i``; any pair of devices.

    For a combined ``[2, N, ...]`` layer cache, copy ``kv_cache[0]`` and
    ``kv_cache[1]`` (see ``paged.kernels.layout.split_kv_cache``).
    """
    check_copy_blocks(src, dst, src_block_ids, dst_block_ids)
    if src_block_ids.numel() == 0:
        return
    src_ids = src_block_ids.to(device=src.device, dtype=torch.int64)
    dst_ids = dst_block_ids.to(device=dst.device, dtype=torch.int64)
    for name, ids, limit in (
        ("src_block_ids", src_ids, src.shape[0]),
        ("dst_block_ids", dst_ids, dst.shape[0]),
    ):
        if int(ids.min()) < 0 or int(ids.max()) >= limit:
            raise ValueError(
                f"{name} must be in [0, {limit}), got range [{int(ids.min())}, {int(ids.max())}]"
            )
    if is_fp8(src.dtype) and dst.dtype == src.dtype:
        # torch has no CPU index_copy_ for fp8 dtypes; a block copy moves bytes anyway.
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    gathered = src.index_select(0, src_ids).to(dst.device)
    dst.index_copy_(0, dst_ids, gathered)
