"""Gated activations over paged.kernels.ops."""

from __future__ import annotations

import torch
from torch import nn

from paged.kernels import ops
from paged.runner.layers import cpu_eager


class SiluAndMul(nn.Module):
    """[T, 2I] -> [T, I]: silu(first half) * second half (Llama's SwiGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_eager.cpu_fast_path(x) and x.dim() == 2:
            return cpu_eager.silu_and_mul(x)
        return ops.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """[T, 2I] -> [T, I]: gelu_tanh(first half) * second half (Gemma's GeGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_eager.cpu_fast_path(x) and x.dim() == 2:
            return cpu_eager.gelu_tanh_and_mul(x)
        return ops.gelu_tanh_and_mul(x)


_ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def get_gated_activation(hidden_act: str) -> nn.Module:
    """The gated activation for an HF `hidden_act` name (ValueError if unsupported)."""
    if hidden_act not in _ACTIVATIONS:
        raise ValueError(
            f"hidden_act: {hidden_act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[hidden_act]()
