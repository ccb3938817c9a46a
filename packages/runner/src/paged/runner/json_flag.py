"""A flag whose value is a JSON object: `--hf-overrides`, `--pooler-config`.

The CLI hands over the flag's text, `LLM(...)` / `EngineArgs` a dict; both
come out as a dict with string keys, or a ValueError that names the flag.
vLLM 0.33 reads such flags with `json.loads` inside argparse
(vllm/engine/arg_utils.py:161-185, `parse_type` / `union_dict_and_str`);
paged checks the value is an object too, before any model loads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def parse_json_object(value: str | Mapping[str, Any], flag: str) -> dict[str, Any]:
    """`value` as a dict; ValueError `"{flag}: not valid JSON (...)"` or
    `"{flag}: must be a JSON object, got list"` (the type it got)."""
    parsed: object = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: not valid JSON ({exc})") from exc
    if not isinstance(parsed, Mapping):
        raise ValueError(f"{flag}: must be a JSON object, got {type(parsed).__name__}")
    return {str(k): v for k, v in parsed.items()}
