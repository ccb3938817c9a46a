"""Reference rotary position embedding (NeoX and GPT-J styles)."""

from __future__ import annotations

import torch

from paged.kernels.validation import check_rotary

__all__ = ["rotary_embedding"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, H, rotary_dim] float32; cos/sin: [T, 1, rotary_dim // 2]
    if is_neox:
        # NeoX: the two halves of the rotary dims form the (x1, x2) pairs.
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    # GPT-J: adjacent dims (2i, 2i+1) form the pairs.
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq * D]
    key: torch.Tensor,  # [T, Hkv * D]
    head_size: int,
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos | sin
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` dims of every head; returns new ``(query, key)``.

    Inputs are not modified. Dims past ``rotary_dim`` (partial rotary) pass through.
    Computed in float32, returned in the input dtype.
    """
    check_rotary(positions, query, key, head_size, cos_sin_cache)
    if positions.numel() and (
        int(positions.min()) < 0 or int(positions.max()) >= cos_sin_cache.shape[0]
    ):
        raise ValueError(
            f"positions must be in [0, {cos_sin_cache.shape[0]}), got range "
            f"[{int(positions.min())}, {int(positions.max())}]"
        )
    rotary_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.to(torch.int64)].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    outputs = []
    for x in (query, key):
        heads = x.float().reshape(x.shape[0], -1, head_size)
        rotated = _rotate(heads[..., :rotary_dim], cos, sin, is_neox)
        heads = torch.cat([rotated, heads[..., rotary_dim:]], dim=-1)
        outputs.append(heads.reshape(x.shape).to(x.dtype))
    return outputs[0], outputs[1]
