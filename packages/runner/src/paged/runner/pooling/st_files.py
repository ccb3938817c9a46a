"""Reading a sentence-transformers directory the way vLLM 0.33 does.

- `modules.json` lists the modules; the first Pooling module's folder holds
  `config.json` with `pooling_mode_*` flags (or a `pooling_mode` string); a
  Normalize module anywhere means `use_activation=True` (normalised embeddings).
  vllm/transformers_utils/config.py:92-108 (module type names), :1012-1093
  (get_pooling_config), :1096-1106 (parse_pooling_type).
- Dense modules (`2_Dense/config.json` + `model.safetensors`) form the
  projector applied after pooling. vllm/transformers_utils/config.py:1338-1368
  (try_get_dense_modules) and vllm/model_executor/models/adapters.py:40-115
  (_load_st_projector, _load_dense_weights: keys `weight`, `linear.weight`,
  `dense.weight`).

Only local directories: paged loads models from disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from paged.runner.pooling.config import SEQ_POOLING_TYPES, TOK_POOLING_TYPES

_POOLING_TYPES = {
    "sentence_transformers.models.Pooling",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
}
_NORMALIZE_TYPES = {
    "sentence_transformers.models.Normalize",
    "sentence_transformers.base.modules.normalize.Normalize",
    "sentence_transformers.sentence_transformer.modules.normalize.Normalize",
}
_DENSE_TYPES = {
    "sentence_transformers.models.Dense",
    "sentence_transformers.base.modules.dense.Dense",
    "pylate.models.Dense.Dense",
}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: cannot read {str(path)!r} as JSON ({exc})") from exc


def read_modules(model_dir: str | Path | None) -> list[dict[str, Any]] | None:
    """The entries of `modules.json`, or None when the directory has none."""
    if model_dir is None:
        return None
    path = Path(model_dir) / "modules.json"
    if not path.is_file():
        return None
    modules = _read_json(path)
    if isinstance(modules, dict):  # an older layout nests the list
        modules = modules.get("modules", [])
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"model: {str(path)!r} is not a list of module entries")
    return modules


def parse_pooling_type(pooling_name: str) -> str:
    """`pooling_mode_mean_tokens` -> MEAN, `pooling_mode_lasttoken` -> LAST (vLLM's rule)."""
    name = pooling_name.replace("pooling_mode_", "")
    name = name.split("_", 1)[0]
    if "lasttoken" in name:
        name = "last"
    return name.upper()


def st_pooling_defaults(model_dir: str | Path | None) -> dict[str, Any] | None:
    """PoolerConfig defaults from the sentence-transformers files, or None without them.

    Like vLLM, a directory with `modules.json` but no Pooling module yields
    None (no defaults), and one with a Pooling module always sets
    `use_activation` to whether a Normalize module is listed.
    """
    modules = read_modules(model_dir)
    if modules is None or model_dir is None:
        return None
    pooling = next((m for m in modules if m.get("type") in _POOLING_TYPES), None)
    if pooling is None:
        return None
    normalize = any(m.get("type") in _NORMALIZE_TYPES for m in modules)
    config: dict[str, Any] = {"use_activation": normalize}
    path = Path(model_dir) / str(pooling.get("path", "")) / "config.json"
    pooling_dict = _read_json(path) if path.is_file() else {}
    for key, val in pooling_dict.items():
        if key == "pooling_mode" and isinstance(val, str):
            name = val
        elif val is True:
            name = key
        else:
            continue
        kind = parse_pooling_type(name)
        # Later flags win, as in vLLM's loop; unknown ones (weightedmean,
        # include_prompt, ...) are skipped.
        if kind in SEQ_POOLING_TYPES:
            config["seq_pooling_type"] = kind
        elif kind in TOK_POOLING_TYPES:
            config["tok_pooling_type"] = kind
    return config


@dataclass(frozen=True)
class DenseLayer:
    """One sentence-transformers Dense module: y = act(x @ weight.T + bias)."""

    weight: torch.Tensor  # [out_features, in_features], float32
    bias: torch.Tensor | None
    activation: str  # the module's `activation_function` (a torch.nn.modules qualname)


def load_st_dense_layers(model_dir: str | Path | None) -> list[DenseLayer]:
    """The Dense modules of a sentence-transformers directory, in order ([] if none).

    A Dense folder without a config or weights is skipped, as vLLM skips it.
    """
    modules = read_modules(model_dir)
    if not modules or model_dir is None:
        return []
    layers: list[DenseLayer] = []
    for module in modules:
        if module.get("type") not in _DENSE_TYPES:
            continue
        folder = Path(model_dir) / str(module.get("path", ""))
        if not (folder / "config.json").is_file():
            continue
        cfg = _read_json(folder / "config.json")
        state = _dense_state(folder)
        if state is None:
            continue
        weight, bias = state
        expected = (int(cfg["out_features"]), int(cfg["in_features"]))
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"model: Dense weight in {str(folder)!r} has shape {list(weight.shape)}, "
                f"config says {list(expected)}"
            )
        if not cfg.get("bias", True):
            bias = None
        act = str(cfg.get("activation_function") or "torch.nn.modules.linear.Identity")
        layers.append(DenseLayer(weight=weight, bias=bias, activation=act))
    return layers


def _dense_state(folder: Path) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    for filename in ("model.safetensors", "pytorch_model.bin"):
        path = folder / filename
        if not path.is_file():
            continue
        if filename.endswith(".safetensors"):
            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        for key in ("weight", "linear.weight", "dense.weight"):
            if key in state:
                bias = state.get(key.replace("weight", "bias"))
                return state[key].float(), None if bias is None else bias.float()
    return None
