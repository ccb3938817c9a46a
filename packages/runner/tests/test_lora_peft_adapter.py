"""Reading PEFT adapter directories: scaling as PEFT computes it, and every refusal by name."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from paged.runner.lora.config import LoRAConfig
from paged.runner.lora.peft_adapter import load_peft_adapter

PREFIX = "base_model.model.model.layers.0"


def write_adapter(
    path: Path,
    config: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    rank: int = 4,
) -> Path:
    """A PEFT-shaped adapter directory (what PeftModel.save_pretrained writes)."""
    path.mkdir(parents=True, exist_ok=True)
    base = {"r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps({**base, **(config or {})}))
    if tensors is None:
        torch.manual_seed(0)
        tensors = {
            f"{PREFIX}.self_attn.q_proj.lora_A.weight": torch.randn(rank, 16),
            f"{PREFIX}.self_attn.q_proj.lora_B.weight": torch.randn(16, rank),
            f"{PREFIX}.mlp.down_proj.lora_A.weight": torch.randn(rank, 24),
            f"{PREFIX}.mlp.down_proj.lora_B.weight": torch.randn(16, rank),
        }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_modules_keys_shapes_and_scaling(tmp_path: Path) -> None:
    weights = load_peft_adapter(str(write_adapter(tmp_path / "a")))
    assert weights.rank == 4 and weights.scaling == 8 / 4
    assert sorted(weights.modules) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.self_attn.q_proj",
    ]
    q = weights.modules["model.layers.0.self_attn.q_proj"]
    assert q.lora_a.shape == (4, 16) and q.lora_b.shape == (16, 4)
    assert q.lora_a.dtype == torch.float32


def test_rslora_scaling(tmp_path: Path) -> None:
    weights = load_peft_adapter(str(write_adapter(tmp_path / "a", {"use_rslora": True})))
    assert weights.scaling == pytest.approx(8 / math.sqrt(4))


def test_rank_and_alpha_patterns_fold_into_b(tmp_path: Path) -> None:
    """PEFT's per-module alpha: the module's own scaling is folded into its B."""
    torch.manual_seed(0)
    b = torch.randn(16, 4)
    tensors = {
        f"{PREFIX}.self_attn.q_proj.lora_A.weight": torch.randn(4, 16),
        f"{PREFIX}.self_attn.q_proj.lora_B.weight": b,
        f"{PREFIX}.mlp.down_proj.lora_A.weight": torch.randn(6, 24),
        f"{PREFIX}.mlp.down_proj.lora_B.weight": torch.randn(16, 6),
    }
    config = {"rank_pattern": {"down_proj": 6}, "alpha_pattern": {"q_proj": 2}}
    weights = load_peft_adapter(str(write_adapter(tmp_path / "a", config, tensors)))
    assert weights.rank == 6 and weights.scaling == 2.0
    folded = weights.modules["model.layers.0.self_attn.q_proj"].lora_b
    assert torch.allclose(folded * weights.scaling, b * (2 / 4))


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"bias": "all"}, "bias"),
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
        ({"target_modules": ["embed_tokens"]}, "target_modules"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights"),
        ({"r": 0}, "r"),
        ({"lora_alpha": "x"}, "lora_alpha"),
        ({"lora_bias": True}, "lora_bias"),
    ],
)
def test_unsupported_fields_are_named(tmp_path: Path, config: dict[str, Any], field: str) -> None:
    path = write_adapter(tmp_path / "a", config)
    with pytest.raises(ValueError, match=f"^{field}:"):
        load_peft_adapter(str(path))


def test_rank_above_max_lora_rank(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", {"r": 16}, rank=16)
    with pytest.raises(ValueError, match="rank 16 is greater than max_lora_rank 8"):
        load_peft_adapter(str(path), LoRAConfig(max_lora_rank=8))


def test_missing_config_and_required_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        load_peft_adapter(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"adapter_config.json is missing"):
        load_peft_adapter(str(tmp_path / "empty"))
    path = write_adapter(tmp_path / "a")
    (path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(ValueError, match="missing required configuration fields"):
        load_peft_adapter(str(path))
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_peft_adapter(str(path))


def test_bin_is_refused_and_corrupt_safetensors_named(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"adapter_model\.bin is a pickle"):
        load_peft_adapter(str(path))
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="cannot read"):
        load_peft_adapter(str(path))


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("base_model.model.model.embed_tokens.lora_embedding_A", "embedding LoRA"),
        ("base_model.model.lm_head.lora_A.weight", "cannot carry LoRA"),
        (f"{PREFIX}.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
        (f"{PREFIX}.self_attn.q_proj.weight", "not a LoRA tensor"),
    ],
)
def test_unsupported_tensors_are_named(tmp_path: Path, key: str, match: str) -> None:
    path = write_adapter(tmp_path / "a", tensors={key: torch.zeros(4, 16)})
    with pytest.raises(ValueError, match=match):
        load_peft_adapter(str(path))


def test_unpaired_and_mismatched_ranks(tmp_path: Path) -> None:
    one = {f"{PREFIX}.self_attn.q_proj.lora_A.weight": torch.zeros(4, 16)}
    with pytest.raises(ValueError, match="only one of lora_A / lora_B"):
        load_peft_adapter(str(write_adapter(tmp_path / "a", tensors=one)))
    odd = {
        f"{PREFIX}.self_attn.q_proj.lora_A.weight": torch.zeros(4, 16),
        f"{PREFIX}.self_attn.q_proj.lora_B.weight": torch.zeros(16, 3),
    }
    with pytest.raises(ValueError, match="ranks differ"):
        load_peft_adapter(str(write_adapter(tmp_path / "b", tensors=odd)))
