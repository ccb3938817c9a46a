"""Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors).

What is checked and refused follows vLLM 0.33 (vllm/lora/peft_helper.py:53-87,
188-202 and vllm/lora/lora_model.py:239-316): a positive `r`, `bias` "none",
no DoRA, no `modules_to_save`, no PiSSA-style inits that rewrite the base
weights, the safetensors keys as the source of truth for what is targeted.
paged refuses `adapter_model.bin` (a pickle; vLLM loads it with
`torch.load(weights_only=True)`) and embedding / lm_head targets (vLLM 0.33
serves neither from PEFT's own tensors either). Each refusal is a ValueError
naming the field or module.

PEFT's per-module `rank_pattern` / `alpha_pattern` are honoured by folding the
module's own scaling into its B (B * module_scaling / adapter_scaling), so the
whole adapter keeps one `scaling` and one (the largest) `rank`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from paged.runner.lora.config import LoRAConfig
from paged.runner.lora.weights import LORA_TARGET_MODULES, LoRAAdapterWeights, LoRAModuleWeights

__all__ = ["load_peft_adapter"]

# PEFT's key: "base_model.model.<module path>.lora_A.weight" (or lora_B).
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$"
)
# Inits that change the base weights when PEFT loads the adapter (vLLM refuses them too).
_SAFE_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


def load_peft_adapter(path: str, lora_config: LoRAConfig | None = None) -> LoRAAdapterWeights:
    """The adapter at `path` (a PEFT directory), float32 on the CPU, checked as vLLM checks it.

    With `lora_config`, a rank above `max_lora_rank` is refused here too (the
    manager checks it again against the model's shapes).
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"lora_path: {path!r} is not a directory (a PEFT adapter is a directory)")
    config = _read_config(root / "adapter_config.json")
    rank, alpha = _rank_alpha(config)
    use_rslora = bool(config.get("use_rslora", False))
    _refuse_unsupported(config)
    rank_pattern: dict[str, int] = dict(config.get("rank_pattern") or {})
    alpha_pattern: dict[str, float] = dict(config.get("alpha_pattern") or {})
    max_rank = max([rank, *rank_pattern.values()])
    if lora_config is not None and max_rank > lora_config.max_lora_rank:
        raise ValueError(
            f"r: LoRA rank {max_rank} is greater than max_lora_rank {lora_config.max_lora_rank}"
        )
    scaling = _scaling(rank, alpha, use_rslora)
    pairs = _read_tensors(root)
    modules: dict[str, LoRAModuleWeights] = {}
    for module, (a, b) in sorted(pairs.items()):
        m_rank = _match(rank_pattern, module, rank)
        m_scaling = _scaling(m_rank, _match(alpha_pattern, module, alpha), use_rslora)
        if a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{module}: lora_A is {tuple(a.shape)} and lora_B is {tuple(b.shape)}; "
                "their ranks differ"
            )
        if m_scaling != scaling:
            b = b * (m_scaling / scaling)
        modules[module] = LoRAModuleWeights(lora_a=a, lora_b=b)
    return LoRAAdapterWeights(rank=max_rank, scaling=scaling, modules=modules)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"lora_path: {path} is missing (not a PEFT adapter directory)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in config]
    if missing:
        raise ValueError(f"{path}: missing required configuration fields: {missing}")
    return config


def _rank_alpha(config: dict[str, Any]) -> tuple[int, float]:
    rank, alpha = config["r"], config["lora_alpha"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"r: LoRA rank must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"lora_alpha: must be a number, got {alpha!r}")
    for key, value in (config.get("rank_pattern") or {}).items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"rank_pattern: the rank for {key!r} must be a positive integer")
    return rank, float(alpha)


def _refuse_unsupported(config: dict[str, Any]) -> None:
    """vLLM's feature checks (peft_helper.py:53-87), each naming its field."""
    if config.get("bias", "none") != "none":
        raise ValueError(f"bias: adapter bias is not supported (got {config['bias']!r})")
    if config.get("use_dora"):
        raise ValueError("use_dora: DoRA adapters are not supported")
    if config.get("modules_to_save"):
        raise ValueError(
            f"modules_to_save: {config['modules_to_save']!r} is not supported (an adapter "
            "that replaces whole modules of the base model)"
        )
    if config.get("lora_bias"):
        raise ValueError("lora_bias: LoRA bias is not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _SAFE_INITS:
        raise ValueError(
            f"init_lora_weights: {init!r} modifies the base model's weights when PEFT loads "
            "the adapter; convert it to a plain LoRA adapter first"
        )
    for field in ("alora_invocation_tokens", "layer_replication", "use_bdlora", "use_qalora"):
        if config.get(field):
            raise ValueError(f"{field}: not supported")
    targets = config["target_modules"]
    if isinstance(targets, list):
        bad = [t for t in targets if str(t).rsplit(".", 1)[-1] not in LORA_TARGET_MODULES]
        if bad:
            raise ValueError(
                f"target_modules: {bad} cannot carry LoRA here (supported: "
                f"{list(LORA_TARGET_MODULES)})"
            )
    elif not isinstance(targets, str):
        raise ValueError(f"target_modules: expected a list or a regex string, got {targets!r}")


def _read_tensors(root: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path -> (A [r, in], B [out, r]) float32; the keys decide what is targeted."""
    file = root / "adapter_model.safetensors"
    if not file.is_file():
        if (root / "adapter_model.bin").is_file() or (root / "adapter_model.pt").is_file():
            raise ValueError(
                f"{root}: adapter_model.bin is a pickle and is not loaded; save the adapter "
                "with safetensors (PEFT's default, save_pretrained(safe_serialization=True))"
            )
        raise ValueError(f"{root} doesn't contain adapter_model.safetensors")
    a_of: dict[str, torch.Tensor] = {}
    b_of: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                module, ab = _parse_key(key, file)
                (a_of if ab == "A" else b_of)[module] = f.get_tensor(key).to(torch.float32)
    except (OSError, SafetensorError) as exc:  # a missing or corrupt file
        raise ValueError(f"{file}: cannot read ({exc})") from exc
    if not a_of and not b_of:
        raise ValueError(f"{file} holds no LoRA tensors")
    unpaired = sorted(set(a_of) ^ set(b_of))
    if unpaired:
        raise ValueError(f"{file}: modules with only one of lora_A / lora_B: {unpaired}")
    return {m: (a_of[m], b_of[m]) for m in a_of}


def _parse_key(key: str, file: Path) -> tuple[str, str]:
    if "lora_embedding" in key or "magnitude_vector" in key:
        what = "embedding LoRA" if "lora_embedding" in key else "DoRA magnitudes"
        raise ValueError(f"{file}: {key!r} ({what}) is not supported")
    match = _KEY.match(key)
    if match is None:
        raise ValueError(
            f"{file}: {key!r} is not a LoRA tensor (expected '<module>.lora_A.weight')"
        )
    module = match["module"]
    if module.rsplit(".", 1)[-1] not in LORA_TARGET_MODULES:
        raise ValueError(
            f"{file}: module {module!r} cannot carry LoRA here (expected target modules in "
            f"{list(LORA_TARGET_MODULES)})"
        )
    return module, match["ab"]


def _match(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's pattern rule: a key matches a suffix of the module path at a '.' boundary."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank
