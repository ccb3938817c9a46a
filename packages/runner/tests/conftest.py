"""Shared fixtures for paged.runner tests: tiny random Hugging Face checkpoints.

`make_tiny_checkpoint(family, path, **overrides)` saves a 2-layer, hidden-64
model of the given family with random weights (seeded) into `path` and returns
the path; tests compare paged's model against transformers on it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

TINY_BASE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "tie_word_embeddings": False},
    "llama_tied_scaled": {
        "model_type": "llama",
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"model_type": "mistral", "sliding_window": None, "head_dim": 16},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": False},
}


def make_tiny_checkpoint(family: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random model of `family` (a FAMILIES key) to `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    kwargs = {**TINY_BASE, **spec, **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    auto: Any = AutoModelForCausalLM  # transformers' auto classes are untyped
    model = auto.from_config(config, dtype=torch.float32)
    # Random init leaves norms at 1 and biases at 0; perturb them so the
    # parity checks exercise every weight.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(path))
    return path


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Factory fixture: tiny_checkpoint(family, **config_overrides) -> checkpoint dir."""
    counter = iter(range(1000))

    def build(family: str, seed: int = 0, **overrides: Any) -> Path:
        return make_tiny_checkpoint(
            family, tmp_path / f"{family}-{next(counter)}", seed=seed, **overrides
        )

    return build
