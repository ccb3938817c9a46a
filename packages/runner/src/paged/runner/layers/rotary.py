"""Rotary position embedding over paged.kernels.ops, with rope scaling from the HF config."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paged.kernels import ops, reference
from paged.kernels.rope import RopeScaling
from paged.runner.cpu_step import ops as native


def rope_scaling_from_hf(rope_parameters: dict[str, Any] | None) -> RopeScaling | None:
    """Translate an HF `rope_parameters` dict (transformers v5) to a RopeScaling.

    ValueError naming the rope type for the ones paged does not implement.
    """
    if not rope_parameters:
        return None
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(rope_parameters["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(rope_parameters["factor"]),
            low_freq_factor=float(rope_parameters["low_freq_factor"]),
            high_freq_factor=float(rope_parameters["high_freq_factor"]),
            original_max_position_embeddings=int(
                rope_parameters["original_max_position_embeddings"]
            ),
        )
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported (supported: default, linear, "
        "llama3); pick a checkpoint without it"
    )


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flattened q [T, Hq*D] and k [T, Hkv*D] at `positions`.

    The cos/sin table covers `max_position` positions and is a non-persistent
    buffer (it is derived from the config, never loaded).
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: RopeScaling | None,
        *,
        is_neox_style: bool = True,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.is_neox_style = is_neox_style
        # Kept in float32 whatever the model dtype: HF rotates in float32 too.
        cache = ops.compute_cos_sin_cache(
            rotary_dim, max_position, base, rope_scaling, torch.float32
        )
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)
        self.rotary_dim = rotary_dim
        # Reference-backend fast path: the [T, 1, D] cos / signed-sin rows of the
        # last positions tensor seen. Every layer of a step passes the same one,
        # so the gather runs once per step instead of once per layer.
        self._step: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fast = (
            self.is_neox_style
            and self.rotary_dim == self.head_size
            and ops.backend_for(query) is reference
        )
        if not fast:
            return ops.rotary_embedding(
                positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style
            )
        if query.dtype is torch.bfloat16 and key.dtype is torch.bfloat16 and native.available():
            # One C call (cpu_step/step_ops.c), the reference's float32 arithmetic exactly.
            if positions.dtype is not torch.int64 or not positions.is_contiguous():
                positions = positions.to(torch.int64).contiguous()
            return native.rotary_neox(positions, query, key, self.head_size, self.cos_sin_cache)
        cos, sin = self._cos_sin(positions)
        joint = _adjacent_columns(query, key)
        if joint is not None:
            # q and k are neighbouring column ranges of one [T, (Hq+Hkv)*D] tensor
            # (the split qkv projection): every head rotates the same way, so one
            # rotation over both halves the ops; results are the same numbers.
            rotated = self._rotate(joint, cos, sin)
            return rotated[:, : query.shape[1]], rotated[:, query.shape[1] :]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cat(cos, cos), cat(-sin, sin)) rows for `positions`, [T, 1, D] float32."""
        step = self._step
        if step is not None and step[0] is positions and step[1] == positions._version:
            return step[2], step[3]
        max_position = self.cos_sin_cache.shape[0]
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= max_position):
            raise ValueError(
                f"positions must be in [0, {max_position}), got range "
                f"[{int(positions.min())}, {int(positions.max())}]"
            )
        cos, sin = self.cos_sin_cache[positions.to(torch.int64)].float().chunk(2, dim=-1)
        cos_full = torch.cat([cos, cos], dim=-1)[:, None, :]
        sin_signed = torch.cat([-sin, sin], dim=-1)[:, None, :]
        self._step = (positions, positions._version, cos_full, sin_signed)
        return cos_full, sin_signed

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """NeoX rotation of every head, bit-identical to paged.kernels.reference's.

        The reference forms (x1*cos - x2*sin, x2*cos + x1*sin); here that is
        x*cat(cos, cos) + cat(x2, x1)*cat(-sin, sin): the same products and
        sums (a + (-b) == a - b exactly), in four ops instead of about ten.
        """
        if x.dim() != 2 or x.shape[0] != cos.shape[0] or x.shape[1] % self.head_size:
            raise ValueError(
                f"query/key must be [T={cos.shape[0]}, H * {self.head_size}], got {tuple(x.shape)}"
            )
        heads = x.float().reshape(x.shape[0], -1, self.head_size)
        half = self.head_size // 2
        swapped = torch.cat([heads[..., half:], heads[..., :half]], dim=-1)
        out = heads * cos + swapped * sin
        return out.view(x.shape).to(x.dtype)


def _adjacent_columns(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The [T, A + B] view covering a [T, A] and b [T, B] if b's columns follow a's in memory."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0] or a.dtype != b.dtype:
        return None
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        return None
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    if b.storage_offset() != a.storage_offset() + a.shape[1]:
        return None
    if a.shape[0] > 1 and a.stride(0) < a.shape[1] + b.shape[1]:
        return None  # rows would overlap
    return a.as_strided((a.shape[0], a.shape[1] + b.shape[1]), a.stride(), a.storage_offset())
