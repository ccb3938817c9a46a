"""``paged.kernels.reference``: every op in pure torch (CPU and CUDA), the readable definition.

Signatures are identical to ``paged.kernels.triton_ops`` (checked statically by
``paged.kernels.interface.KernelBackend``).
"""

from paged.kernels.reference.attention import paged_attention
from paged.kernels.reference.cache import copy_blocks, reshape_and_cache
from paged.kernels.reference.layers import (
    fused_add_rms_norm,
    gelu_tanh_and_mul,
    rms_norm,
    silu_and_mul,
)
from paged.kernels.reference.lora import lora_expand, lora_shrink
from paged.kernels.reference.rotary import rotary_embedding
from paged.kernels.reference.sampling import apply_penalties, apply_top_k_top_p
from paged.kernels.rope import RopeScaling, compute_cos_sin_cache

__all__ = [
    "RopeScaling",
    "apply_penalties",
    "apply_top_k_top_p",
    "compute_cos_sin_cache",
    "copy_blocks",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
