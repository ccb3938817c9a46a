"""``paged.kernels.triton_ops``: every op as a Triton kernel behind a checking wrapper.

Importing this module imports triton. Signatures match ``paged.kernels.reference``
(checked statically through ``paged.kernels.interface.KernelBackend``). Tensors must
be on CUDA, or on the CPU with ``TRITON_INTERPRET=1`` (tests).

Not Triton kernels here, on purpose:
- ``compute_cos_sin_cache`` is a one-off table build, shared with the reference.
- ``apply_top_k_top_p`` / ``apply_penalties`` are the torch implementations: the
  issue asks for Triton only where it is measured faster on a GPU, and no GPU
  measurement has been made.
- ``copy_blocks`` between *different* devices is a DMA transfer done by torch.
"""

import os

# Triton 3.9 warns on every first compile unless this is set; "1" keeps its
# current default (FP fusion on). Without it, any test suite running with
# warnings-as-errors fails on a GPU. setdefault: a user's choice wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from paged.kernels.reference.sampling import apply_penalties, apply_top_k_top_p
from paged.kernels.rope import RopeScaling, compute_cos_sin_cache
from paged.kernels.triton_ops.attention import (
    AttentionLaunch,
    choose_launch,
    paged_attention,
    paged_attention_split_kv,
)
from paged.kernels.triton_ops.cache import copy_blocks, reshape_and_cache
from paged.kernels.triton_ops.layers import (
    fused_add_rms_norm,
    gelu_tanh_and_mul,
    rms_norm,
    silu_and_mul,
)
from paged.kernels.triton_ops.lora import lora_expand, lora_shrink
from paged.kernels.triton_ops.rotary import rotary_embedding

__all__ = [
    "AttentionLaunch",
    "RopeScaling",
    "apply_penalties",
    "apply_top_k_top_p",
    "choose_launch",
    "compute_cos_sin_cache",
    "copy_blocks",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "paged_attention_split_kv",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
