"""Hugging Face architecture name -> model class.

The table maps the `architectures[0]` string of a config.json (or the
`general.architecture` of a GGUF file, translated by the loader) to the class
implementing it. Classes are imported lazily so that reading a config does not
import model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged.runner.models.interface import CausalLMClass

# The Llama-family entries share LlamaForCausalLM; the differences (qkv bias,
# q/k norm, sliding window, tied embeddings) are read from the config.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("paged.runner.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("paged.runner.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("paged.runner.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("paged.runner.models.llama", "LlamaForCausalLM"),
    # Gemma 3: sandwich norms, per-type rope bases, interleaved sliding layers.
    "Gemma3ForCausalLM": ("paged.runner.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": (
        "paged.runner.models.gemma3_mm",
        "Gemma3ForConditionalGeneration",
    ),
}


# Architectures whose model takes encoder inputs (images) and implements
# `paged.runner.models.interface.SupportsMultiModal`.
_MULTIMODAL = frozenset({"Gemma3ForConditionalGeneration"})


def is_multimodal(architecture: str) -> bool:
    return architecture in _MULTIMODAL


def supported_architectures() -> list[str]:
    """The Hugging Face architecture names paged can run, sorted."""
    return sorted(_MODELS)


def is_supported(architecture: str) -> bool:
    return architecture in _MODELS


def check_architecture(architecture: str) -> None:
    """Raise a ValueError naming the supported architectures if `architecture` is not one."""
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported by paged; "
            f"supported architectures: {', '.join(supported_architectures())}. "
            "Pass --model pointing at a checkpoint of one of these."
        )


def resolve_model_class(architecture: str) -> CausalLMClass:
    """Return the class implementing `architecture` (ValueError if unsupported)."""
    check_architecture(architecture)
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(module_name)
    cls: CausalLMClass = getattr(module, class_name)
    return cls
