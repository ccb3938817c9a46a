"""Rotary position embedding over paged.kernels.ops, with rope scaling from the HF config."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paged.kernels import ops
from paged.kernels.rope import RopeScaling


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

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rotary_embedding(
            positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style
        )
