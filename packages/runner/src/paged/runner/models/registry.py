"""Hugging Face architecture name -> model class.

The table (architectures.py) names each class's module; the class is imported
here, lazily, so that reading a config does not import model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from paged.runner.models.architectures import (
    MODELS,
    check_architecture,
    is_multimodal,
    is_supported,
    supported_architectures,
)

if TYPE_CHECKING:
    from paged.runner.models.interface import CausalLMClass

__all__ = [
    "check_architecture",
    "is_multimodal",
    "is_supported",
    "resolve_model_class",
    "supported_architectures",
]


def resolve_model_class(architecture: str) -> CausalLMClass:
    """Return the class implementing `architecture` (ValueError if unsupported)."""
    check_architecture(architecture)
    module_name, class_name = MODELS[architecture]
    module = importlib.import_module(module_name)
    cls: CausalLMClass = getattr(module, class_name)
    return cls
