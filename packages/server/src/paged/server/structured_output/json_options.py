"""How JSON grammars are shaped engine-wide: whitespace and closed objects.

Plain data (no llguidance import), so the engine core's start-up and the CLI's
flag check can build it cheaply. vLLM 0.33.0 reads `disable_any_whitespace` and
`disable_additional_properties` from `StructuredOutputsConfig`
(config/structured_outputs.py:30-39) and hands llguidance
`whitespace_flexible = not disable_any_whitespace`
(v1/structured_output/backend_guidance.py:302-328; the request-level flag
of vLLM is not read there, paged honours both); paged adds a bound on
whitespace runs, on by default.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

# Whitespace allowed between two JSON tokens by default: one optional line break,
# then at most this many spaces or tabs (pretty-printing to depth 4 at indent 2,
# or depth 2 at indent 4). llguidance's flexible default, `[ \t\r\n]+`, lets a
# small model write newline after newline until max_tokens cuts the JSON short.
DEFAULT_MAX_JSON_WHITESPACE = 8


@dataclass(frozen=True, slots=True)
class JsonGrammarOptions:
    """Engine-wide shape of JSON grammars (`--structured-outputs-config`).

    - `disable_any_whitespace` (vLLM): compact JSON, no whitespace at all (a request
      may also ask for it through `structured_outputs.disable_any_whitespace`).
    - `disable_additional_properties` (vLLM, guidance backend): every object schema
      with `properties` and no `additionalProperties` gets `additionalProperties: false`.
    - `max_json_whitespace` (paged): whitespace between two JSON tokens is at most one
      line break followed by this many spaces or tabs; None: any run (vLLM's behaviour).
    """

    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    max_json_whitespace: int | None = DEFAULT_MAX_JSON_WHITESPACE

    def __post_init__(self) -> None:
        limit = self.max_json_whitespace
        if limit is not None and (isinstance(limit, bool) or limit < 0):
            raise ValueError(f"max_json_whitespace must be >= 0 or null, got {limit!r}")

    def llguidance_defaults(self, request_disables_whitespace: bool) -> dict[str, Any]:
        """The `defaults` of llguidance's JSON compiler for one request."""
        if self.disable_any_whitespace or request_disables_whitespace:
            # Compact JSON, as Python's json.dumps(separators=(",", ":")) writes it.
            return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        if self.max_json_whitespace is None:
            return {"whitespace_flexible": True}
        # llguidance matches this pattern once between two tokens: the bound holds.
        pattern = rf"(\x0D?\x0A)?[\x20\x09]{{0,{self.max_json_whitespace}}}"
        return {"whitespace_flexible": True, "whitespace_pattern": pattern}


def forbid_additional_properties(schema: Any) -> Any:
    """A copy of `schema` where each object schema listing properties closes its key set.

    Every nested schema position is visited (properties, items, combinators, $defs...);
    an explicit `additionalProperties` is kept as written.
    """
    schema = copy.deepcopy(schema)
    _close_objects(schema)
    return schema


def _close_objects(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _close_objects(item)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            if isinstance(value, dict):
                for sub in value.values():
                    _close_objects(sub)
        elif key not in ("enum", "const", "default", "examples", "required"):
            _close_objects(value)
    if "additionalProperties" not in node and (
        isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)
    ):
        node["additionalProperties"] = False
