"""The Pooler of a served model, from its resolved `ModelConfig` (pool-models' builders).

The head tensors (a classifier's `score.weight` / `classifier.*`, a
sentence-transformers directory's Dense modules) are read straight from the
checkpoint files: the model class loads the body only. A GGUF has no
sentence-transformers files and no head, so its pooler pools the body's
hidden states (LAST unless `--pooler-config` says otherwise).
"""

from __future__ import annotations

from typing import Any

import torch

from paged.runner.model_config import ModelConfig
from paged.runner.pooling import (
    Pooler,
    build_pooler,
    load_head_state_dict,
    load_st_dense_layers,
)


def hf_config_dict(model_config: ModelConfig) -> dict[str, Any]:
    """The HF config as the plain mapping pool-models' builders read."""
    hf = model_config.hf_config
    data = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
    data.setdefault("architectures", [model_config.architecture])
    return dict(data)


def build_model_pooler(model_config: ModelConfig) -> Pooler:
    """The model's Pooler (ValueError if it has no pooler config)."""
    config = model_config.pooler_config
    if config is None:
        raise ValueError("pooler_config: the model was not configured as a pooling model")
    head: dict[str, torch.Tensor] = {}
    model_dir = None
    if model_config.weights_format == "safetensors":
        model_dir = model_config.model
        head = load_head_state_dict(model_dir, model_config.architecture)
    convert = model_config.convert_type if model_config.runner_type == "pooling" else "embed"
    return build_pooler(
        config,
        model_config.hidden_size,
        head,
        hf_config_dict(model_config),
        dense_layers=load_st_dense_layers(model_dir),
        convert=None if convert == "none" else convert,
    )
