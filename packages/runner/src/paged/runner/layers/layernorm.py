"""RMSNorm over paged.kernels.ops (fused residual add when a residual is given)."""

from __future__ import annotations

import torch
from torch import nn

from paged.kernels import ops
from paged.runner.layers import cpu_eager
from paged.runner.layers.linear import check_shape


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    forward(x) -> normed; forward(x, residual) -> (normed(x + residual), x + residual),
    the pre-norm residual stream of Llama-family decoders in one kernel.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        *,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        # The float32 weight the CPU fast path multiplies by, kept instead of being
        # converted on every call; keyed by the storage it was made from.
        self._weight_f32: tuple[int, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """normed x in the model dtype (x may be the float32 residual stream on CPU)."""
        if cpu_eager.cpu_fast_path(x):
            return cpu_eager.rms_norm(x, self._float_weight(), self.eps, self.weight.dtype)
        return ops.rms_norm(x, self.weight, self.eps)

    def start_residual(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed x, the residual stream): at the first layer of a pre-norm decoder.

        On CPU the stream is a float32 copy of x that `add_residual_norm_`
        then updates in place; elsewhere it is x itself, in the model dtype.
        """
        if cpu_eager.cpu_fast_path(x):
            return cpu_eager.start_residual(x, self._float_weight(), self.eps)
        return ops.rms_norm(x, self.weight, self.eps), x

    def add_residual_norm_(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """normed(x + residual), the stream advanced: in place on CPU, else rebound.

        Returns (normed, stream); on CPU the stream returned is `residual`
        itself after `residual += x`, so pass only a stream that
        `start_residual` made (nobody else holds it).
        """
        if cpu_eager.cpu_fast_path(x):
            return cpu_eager.add_rms_norm_(x, residual, self._float_weight(), self.eps), residual
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu_eager.cpu_fast_path(x):
            return cpu_eager.fused_add_rms_norm(x, residual, self._float_weight(), self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def _float_weight(self) -> torch.Tensor:
        cached = self._weight_f32
        if cached is None or cached[0] != self.weight.data_ptr():
            cached = (self.weight.data_ptr(), self.weight.detach().float())
            self._weight_f32 = cached
        return cached[1]

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        if name != "weight":
            raise ValueError(f"RMSNorm has no parameter {name!r}")
        check_shape(name, loaded, tuple(self.weight.shape))
        self.weight.data.copy_(loaded)
        self._weight_f32 = None  # same storage, new values


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + w).

    Checkpoints store w (zero = identity); the parameter holds 1 + w, added
    once at load time in float32, so the forward is the plain RMSNorm kernel.
    """

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        super().load_weight(name, loaded.float() + 1.0, shard_id)
