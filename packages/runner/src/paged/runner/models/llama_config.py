"""The Llama-family hyper-parameters, read once from a transformers config.

One typed record instead of `getattr(hf_config, ...)` scattered through the
model. The family differences are flags here, not subclasses:

    Llama 2/3, SmolLM2   plain; Llama 3.1 adds llama3 rope scaling; small ones tie embeddings
    Mistral              sliding window on every layer
    Qwen2                q/k/v bias (never on o_proj); optional sliding window on upper layers
    Qwen3                per-head RMSNorm on q and k before rotary (qk_norm); explicit head_dim
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged.kernels.rope import RopeScaling
from paged.runner.layers.rotary import rope_scaling_from_hf


@dataclass(frozen=True)
class LlamaArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    sliding_windows: tuple[int | None, ...]  # per layer

    @classmethod
    def from_hf(cls, hf_config: Any) -> LlamaArchConfig:
        model_type = getattr(hf_config, "model_type", "")
        heads = int(hf_config.num_attention_heads)
        hidden = int(hf_config.hidden_size)
        head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
        rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
        layers = int(hf_config.num_hidden_layers)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            vocab_size=int(hf_config.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(hf_config.intermediate_size),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(rope_parameters.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling_from_hf(rope_parameters),
            max_position_embeddings=int(hf_config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama/Mistral/Qwen3 say so in attention_bias,
            # which for them covers o_proj too; Qwen2's fixed bias does not.
            attention_bias=model_type == "qwen2" or attention_bias,
            o_proj_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            hidden_act=str(getattr(hf_config, "hidden_act", "silu")),
            sliding_windows=_sliding_windows(hf_config, layers),
        )


def _sliding_windows(hf_config: Any, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        # transformers v5 spells out which layers slide (Qwen2's max_window_layers).
        if len(layer_types) != num_layers:
            raise ValueError(
                f"config layer_types has {len(layer_types)} entries for {num_layers} layers"
            )
        return tuple(
            int(window) if t == "sliding_attention" and window else None for t in layer_types
        )
    return tuple(int(window) if window else None for _ in range(num_layers))
