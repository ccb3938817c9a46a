"""Loading local Hugging Face directories: sharded checkpoints and every bad-input case."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged.runner.config import ModelConfig
from paged.runner.loader import iterate_weights, load_model


def _load(path: Path) -> torch.nn.Module:
    model = load_model(ModelConfig.from_pretrained(str(path)), "cpu")
    assert isinstance(model, torch.nn.Module)
    return model


def _reshard(path: Path) -> None:
    """Split model.safetensors into two shards with an index, like large checkpoints."""
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_checkpoint_loads_same_weights(tiny_checkpoint: Callable[..., Path]) -> None:
    single = tiny_checkpoint("qwen3", seed=4)
    sharded = tiny_checkpoint("qwen3", seed=4)
    _reshard(sharded)
    a, b = _load(single), _load(sharded)
    for (name_a, pa), (name_b, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert name_a == name_b
        assert torch.equal(pa, pb), name_a


def test_weights_are_the_checkpoint_tensors(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("qwen2")
    model = _load(path)
    ckpt: dict[str, torch.Tensor] = {}
    for name, tensor in iterate_weights(ModelConfig.from_pretrained(str(path))):
        assert isinstance(tensor, torch.Tensor)  # safetensors: never quantised blocks
        ckpt[name] = tensor
    params = dict(model.named_parameters())
    prefix = "model.layers.1"
    qkv = torch.cat([ckpt[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(params[f"{prefix}.self_attn.qkv_proj.weight"], qkv)
    gate_up = torch.cat([ckpt[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(params[f"{prefix}.mlp.gate_up_proj.weight"], gate_up)
    # Tied: no separate lm_head parameter, the head reads the embedding.
    assert "lm_head.weight" not in params
    assert torch.equal(params["model.embed_tokens.weight"], ckpt["model.embed_tokens.weight"])


def test_missing_shard(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    _reshard(path)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"missing: model-00002-of-00002\.safetensors"):
        _load(path)


def test_truncated_safetensors(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or corrupt"):
        _load(path)


def test_garbage_safetensors(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        _load(path)


def test_missing_tensor(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights model\.layers\.1\.self_attn\.qkv_proj"):
        _load(path)


def test_shape_mismatch_with_config(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    expected = r"'model\.layers\.0\.mlp\.down_proj\.weight': weight has shape \(64, 128\)"
    with pytest.raises(ValueError, match=expected):
        _load(path)


def test_foreign_tensor(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["transformer.h.0.attn.c_attn.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not belong to LlamaForCausalLM"):
        _load(path)
