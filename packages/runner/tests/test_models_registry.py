"""Model registry, kv_cache_specs, and model-construction errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from paged.kvcache import FullAttentionSpec, SlidingWindowSpec
from paged.runner.config import ModelConfig
from paged.runner.loader import load_model
from paged.runner.models.llama import LlamaForCausalLM
from paged.runner.models.registry import (
    check_architecture,
    resolve_model_class,
    supported_architectures,
)


def test_registry_maps_every_family_to_its_class() -> None:
    from paged.runner.models.gemma3 import Gemma3ForCausalLM
    from paged.runner.models.gemma3_mm import Gemma3ForConditionalGeneration

    assert supported_architectures() == [
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ]
    for arch in supported_architectures():
        if arch.startswith("Gemma3"):
            continue
        assert resolve_model_class(arch) is LlamaForCausalLM
    assert resolve_model_class("Gemma3ForCausalLM") is Gemma3ForCausalLM
    assert resolve_model_class("Gemma3ForConditionalGeneration") is Gemma3ForConditionalGeneration
    with pytest.raises(ValueError, match="'GemmaForCausalLM' is not supported"):
        check_architecture("GemmaForCausalLM")


def test_kv_cache_specs_full_and_sliding(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    model = load_model(ModelConfig.from_pretrained(str(path)), "cpu")
    specs = model.kv_cache_specs(16)
    assert list(specs) == [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]
    assert specs["model.layers.0.self_attn.attn"] == FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype="float32"
    )
    assert specs["model.layers.1.self_attn.attn"] == SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype="float32", sliding_window=8
    )
    with pytest.raises(ValueError, match="block_size"):
        model.kv_cache_specs(0)


def test_bf16_model_dtype(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    model = load_model(ModelConfig.from_pretrained(str(path), dtype="bfloat16"), "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    spec = next(iter(model.kv_cache_specs(4).values()))
    assert isinstance(spec, FullAttentionSpec)
    assert spec.dtype == "bfloat16"


def test_unsupported_activation_and_rope(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act: 'gelu' is not supported"):
        load_model(ModelConfig.from_pretrained(str(path)), "cpu")
    path = tiny_checkpoint(
        "llama", rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}
    )
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        load_model(ModelConfig.from_pretrained(str(path)), "cpu")
