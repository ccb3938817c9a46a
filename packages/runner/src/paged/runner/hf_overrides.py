"""`--hf-overrides`: keys set on the model's Hugging Face config before anything reads it.

vLLM 0.33 (vllm/config/model.py:616-630, :555-570; transformers_utils/config.py:989-994):
a JSON object whose flat keys go through `PretrainedConfig.update`, and whose
dict values update a nested sub-config attribute by attribute (or are set as
they are when the attribute is not a config). The typical use is serving an
original checkpoint under another architecture, e.g. Qwen3-Reranker as
`{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":
["no", "yes"], "is_original_qwen3_reranker": true}`. vLLM also takes a Python
callable offline; paged takes the JSON object only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged.runner.json_flag import parse_json_object


def parse_hf_overrides(value: str | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`--hf-overrides` JSON text (or a dict from `LLM(...)`); ValueError naming the flag."""
    if value is None:
        return None
    out = parse_json_object(value, "hf_overrides")
    if "architectures" in out:
        archs = out["architectures"]
        if (
            not isinstance(archs, list)
            or not archs
            or not all(isinstance(a, str) and a for a in archs)
        ):
            raise ValueError(
                "hf_overrides: 'architectures' must be a non-empty list of architecture names, "
                f"got {archs!r}"
            )
    return out


def overridden_architecture(architecture: str, overrides: Mapping[str, Any] | None) -> str:
    """The architecture the model is served as (the override's first, else the config's)."""
    if overrides is not None and "architectures" in overrides:
        return str(overrides["architectures"][0])
    return architecture


def apply_hf_overrides(hf_config: Any, overrides: Mapping[str, Any] | None) -> None:
    """Set `overrides` on `hf_config` in place, as vLLM does (see the module docstring)."""
    if not overrides:
        return
    from transformers import PretrainedConfig

    flat: dict[str, Any] = {}
    for key, value in overrides.items():
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            for sub_key, sub_value in value.items():
                setattr(current, sub_key, sub_value)
        elif isinstance(value, dict):
            setattr(hf_config, key, value)
        else:
            flat[key] = value
    if hasattr(hf_config, "update"):
        hf_config.update(flat)
    else:
        for key, value in flat.items():
            setattr(hf_config, key, value)
