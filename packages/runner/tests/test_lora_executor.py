"""add_lora / remove_lora / list_loras through the executor, and what each refusal says."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits
from paged.runner.executor import UniProcExecutor
from paged.runner.lora.config import LoRAAdapterSpec, LoRAConfig


def write_up_proj_adapter(path: Path, layer: int, rank: int, out: int, hidden: int = 64) -> str:
    """A PEFT adapter with one up_proj pair: A [rank, hidden], B [out, rank]."""
    path.mkdir(parents=True)
    config = {"r": rank, "lora_alpha": 8, "target_modules": ["up_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    key = f"base_model.model.model.layers.{layer}.mlp.up_proj"
    tensors = {
        f"{key}.lora_A.weight": torch.randn(rank, hidden),
        f"{key}.lora_B.weight": torch.randn(out, rank),
    }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def config(path: Path, lora: LoRAConfig | None) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig.from_pretrained(str(path), max_model_len=64),
        cache_config=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 20),
        scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=32),
        lora_config=lora,
    )


def test_add_remove_list_and_refusals(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    base = tiny_checkpoint("llama")  # hidden 64, intermediate 128, 2 layers
    good = write_up_proj_adapter(tmp_path / "good", 1, 4, 128)
    wide = write_up_proj_adapter(tmp_path / "wide", 0, 4, 80)
    deep = write_up_proj_adapter(tmp_path / "deep", 2, 4, 128)
    big = write_up_proj_adapter(tmp_path / "big", 0, 32, 128)
    lora = LoRAConfig(max_loras=2, max_lora_rank=16)
    with UniProcExecutor(config(base, lora)) as executor:
        executor.add_lora(LoRAAdapterSpec("good", good, 1))
        with pytest.raises(ValueError, match="'good' is already loaded"):
            executor.add_lora(LoRAAdapterSpec("good", good, 1))
        with pytest.raises(
            ValueError,
            match=r"'model.layers.0.mlp.up_proj' has lora_A \(4, 64\) and lora_B \(80, 4\); "
            r"the base layer needs lora_A \[r, 64\] and lora_B \[128, r\]",
        ):
            executor.add_lora(LoRAAdapterSpec("wide", wide, 2))
        with pytest.raises(ValueError, match=r"'model.layers.2.mlp.up_proj' does not exist"):
            executor.add_lora(LoRAAdapterSpec("deep", deep, 3))
        with pytest.raises(ValueError, match="rank 32 is greater than max_lora_rank 16"):
            executor.add_lora(LoRAAdapterSpec("big", big, 4))
        with pytest.raises(ValueError, match="does not exist"):
            executor.add_lora(LoRAAdapterSpec("gone", str(tmp_path / "gone"), 5))
        assert executor.list_loras() == ["good"]
        assert executor.remove_lora("good") is True
        assert executor.remove_lora("good") is False
        assert executor.list_loras() == []


def test_without_enable_lora(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    base = tiny_checkpoint("llama")
    good = write_up_proj_adapter(tmp_path / "good", 1, 4, 128)
    with UniProcExecutor(config(base, None)) as executor:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            executor.add_lora(LoRAAdapterSpec("good", good, 1))
        assert executor.list_loras() == [] and executor.remove_lora("good") is False
