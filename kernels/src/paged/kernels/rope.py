"""Rotary position embedding tables: ``RopeScaling`` and ``compute_cos_sin_cache``.

The table is computed once per model in torch (it is tiny) and shared by the
reference and the Triton ``rotary_embedding``; both backends re-export it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["RopeScaling", "RopeType", "compute_cos_sin_cache", "compute_inv_freq"]

RopeType = Literal["default", "linear", "llama3"]
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """The ``rope_scaling`` entry of a HF config, for the rope types paged supports.

    - ``default``: plain RoPE (``factor`` ignored).
    - ``linear``: positions divided by ``factor`` (position interpolation).
    - ``llama3``: Llama 3.1 frequency-dependent scaling; long wavelengths divided by
      ``factor``, short ones kept, a smooth ramp in between, governed by
      ``low_freq_factor``, ``high_freq_factor`` and
      ``original_max_position_embeddings``.
    """

    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {_ROPE_TYPES}, got {self.rope_type!r}")
        if not self.factor > 0:
            raise ValueError(f"factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(
                    "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                    f"{self.low_freq_factor} and {self.high_freq_factor}"
                )
            if self.original_max_position_embeddings <= 0:
                raise ValueError("original_max_position_embeddings must be positive")


def compute_inv_freq(
    rotary_dim: int, base: float, rope_scaling: RopeScaling | None
) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` float32 (after llama3 scaling if any)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim}")
    if not base > 0:
        raise ValueError(f"base must be > 0, got {base}")
    # float32 on purpose, like HF transformers: the checkpoints were trained
    # with these exact (rounded) frequencies.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (float(base) ** exponents)
    if rope_scaling is not None and rope_scaling.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Wavelengths longer than original_len / low_freq_factor are fully
    # interpolated (divided by factor); shorter than original_len /
    # high_freq_factor are kept; in between, a linear blend in 1/wavelen.
    old_len = float(s.original_max_position_embeddings)
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: RopeScaling | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[max_position, rotary_dim]``: columns ``[:rotary_dim//2]`` cos, ``[rotary_dim//2:]`` sin.

    Angles are computed in float32 as HF transformers does (``position * inv_freq``
    rounded once), so cos/sin match the reference implementations bit for bit.
    """
    if max_position <= 0:
        raise ValueError(f"max_position must be positive, got {max_position}")
    inv_freq = compute_inv_freq(rotary_dim, base, rope_scaling)
    t = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
    if rope_scaling is not None and rope_scaling.rope_type == "linear":
        t = t / rope_scaling.factor
    freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)
