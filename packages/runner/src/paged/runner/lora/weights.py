"""An adapter's weights, whatever file they came from (PEFT directory or GGUF LoRA)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LORA_TARGET_MODULES", "LoRAAdapterWeights", "LoRAModuleWeights"]

# Module names (the last part of a Hugging Face module path) LoRA may target.
LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)  # fmt: skip


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One target module's pair, in PEFT's orientation (y += scaling * B @ A @ x).

    `lora_a` is [rank, in_features], `lora_b` is [out_features, rank], float32,
    on the CPU, in Hugging Face layout (GGUF q/k row permutations undone).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass(frozen=True)
class LoRAAdapterWeights:
    """A whole adapter: rank, scaling and the weights of every module it targets.

    `modules` is keyed by the module's Hugging Face path without PEFT's prefixes,
    e.g. "model.layers.3.self_attn.q_proj" (not "base_model.model.", no
    ".lora_A.weight"). `scaling` is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r)
    with rsLoRA.
    """

    rank: int
    scaling: float
    modules: dict[str, LoRAModuleWeights] = field(default_factory=dict)
