"""Checks shared by the Triton wrappers: device, strides, launch sizes."""

from __future__ import annotations

import os

import torch

__all__ = [
    "check_block_contiguous",
    "check_last_dim_contiguous",
    "check_triton_device",
    "interpreting",
    "next_power_of_2",
]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_triton_device(**tensors: torch.Tensor) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""
    for name, t in tensors.items():
        if t.is_cuda or (t.device.type == "cpu" and interpreting()):
            continue
        raise ValueError(
            f"{name} is on {t.device}: paged.kernels.triton_ops needs CUDA tensors (CPU only "
            "with TRITON_INTERPRET=1); use paged.kernels.reference or paged.kernels.ops instead"
        )


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dimension, got strides {t.stride()}"
            )


def check_block_contiguous(name: str, t: torch.Tensor) -> None:
    """Each ``t[i]`` must be one contiguous span (strides of dims 1.. are row-major)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:], strict=True))):
        if size > 1 and stride != expected:
            raise ValueError(
                f"{name} must be contiguous within each block (dims 1..), got strides {t.stride()}"
            )
        expected *= size


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
