"""One entry point for an adapter's weights, whatever its format.

A directory is a PEFT adapter (peft_adapter.py); a file is a llama.cpp GGUF
LoRA (gguf_adapter.py; vLLM does not read these). Both give float32
`LoRAAdapterWeights` in Hugging Face layout; the manager then checks them
against the model's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged.runner.lora.config import LoRAConfig
from paged.runner.lora.peft_adapter import load_peft_adapter
from paged.runner.lora.weights import LoRAAdapterWeights

__all__ = ["BaseModelFacts", "load_adapter"]


@dataclass(frozen=True)
class BaseModelFacts:
    """What reading a GGUF LoRA needs to know of the base model (its Q/K row permutation)."""

    num_heads: int
    num_kv_heads: int
    model_type: str | None

    @classmethod
    def of(cls, text_config: Any) -> BaseModelFacts:
        heads = int(text_config.num_attention_heads)
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        return cls(heads, int(kv_heads), getattr(text_config, "model_type", None))


def load_adapter(path: str, config: LoRAConfig, base: BaseModelFacts) -> LoRAAdapterWeights:
    """The adapter at `path`; ValueError naming the cause when it cannot be read."""
    target = Path(path)
    if target.is_dir():
        return load_peft_adapter(path, config)
    if target.is_file():
        from paged.runner.lora.gguf_adapter import load_gguf_lora

        weights: LoRAAdapterWeights = load_gguf_lora(
            path,
            num_heads=base.num_heads,
            num_kv_heads=base.num_kv_heads,
            model_type=base.model_type,
        )
        return weights
    raise ValueError(f"lora_path: {path!r} does not exist")
