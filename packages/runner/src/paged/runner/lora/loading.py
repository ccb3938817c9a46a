"""One entry point for an adapter's weights, whatever its format.

A directory is a PEFT adapter (peft_adapter.py); a file is a llama.cpp GGUF
LoRA (gguf_adapter.py, which vLLM does not read). Both give float32
`LoRAAdapterWeights` in Hugging Face layout; the manager then checks them
against the model.
"""

from __future__ import annotations

from pathlib import Path

from paged.runner.lora.config import LoRAConfig
from paged.runner.lora.peft_adapter import load_peft_adapter
from paged.runner.lora.weights import LoRAAdapterWeights

__all__ = ["load_adapter"]


def load_adapter(path: str, config: LoRAConfig) -> LoRAAdapterWeights:
    """The adapter at `path`; ValueError naming the cause when it cannot be read."""
    target = Path(path)
    if target.is_dir():
        return load_peft_adapter(path, config)
    if target.is_file():
        from paged.runner.lora.gguf_adapter import load_gguf_lora

        return load_gguf_lora(path)
    raise ValueError(f"lora_path: {path!r} does not exist")
