"""What crosses a pipeline-stage boundary, and the stand-in for layers a stage lacks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class IntermediateTensors:
    """vLLM's IntermediateTensors for the Llama family: the residual stream between stages.

    hidden_states: [T, H] the last layer's output before the residual add;
    residual: [T, H] the running residual (the decoder layers keep them apart
    so the add fuses into the next RMSNorm).
    """

    hidden_states: torch.Tensor
    residual: torch.Tensor

    def packed(self) -> torch.Tensor:
        """[2, T, H]: one contiguous tensor, one message on the wire."""
        return torch.stack([self.hidden_states, self.residual])

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> IntermediateTensors:
        if packed.dim() != 3 or packed.shape[0] != 2:
            raise ValueError(f"packed intermediate tensors must be [2, T, H], got {packed.shape}")
        return cls(packed[0], packed[1])


class PPMissingLayer(nn.Module):
    """A module another pipeline stage holds: no parameters, never called.

    It keeps the module tree's indices (model.layers.{i}) equal to the
    checkpoint's on every stage, so weight names need no renumbering.
    """

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("PPMissingLayer: this layer lives on another pipeline stage")
