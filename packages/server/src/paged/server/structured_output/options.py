"""`--structured-outputs-config` (vLLM's flag): JSON text -> `StructuredOutputOptions`.

vLLM 0.33.0's keys (config/structured_outputs.py) are read with vLLM's meaning
where paged can honour them and refused by name where it cannot (never
silently ignored):

    backend                        "auto" or "guidance" (llguidance is paged's only
                                   backend; "auto" therefore means guidance)
    disable_any_whitespace         compact JSON, no whitespace between tokens
    disable_additional_properties  object schemas with `properties` close their key set
    reasoning_parser               as `--reasoning-parser` (the flag wins when both are set)
    enable_in_reasoning            the grammar constrains the thinking too (default: it
                                   starts after the end-of-think tag)
    reasoning_parser_plugin        refused unless "" (vLLM's default): no parser plugins
    disable_fallback               (older vLLM) accepted; no other backend to fall back to

paged's own: `compile_timeout_s` (wall-clock bound of one grammar compile; past
it the request is a 400), `cache_size` (compiled grammars kept) and
`max_json_whitespace` (whitespace between two JSON tokens: one optional line
break, then at most this many spaces or tabs; default 8; null: unbounded, as
vLLM).

vLLM itself refuses `disable_any_whitespace` unless `backend` is "xgrammar" or
"guidance" (config/structured_outputs.py:67-71); paged's "auto" is guidance, so
paged accepts it with "auto" too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from paged.server.reasoning.registry import check_reasoning_parser
from paged.server.structured_output.defaults import DEFAULT_CACHE_SIZE, DEFAULT_COMPILE_TIMEOUT_S
from paged.server.structured_output.json_options import (
    DEFAULT_MAX_JSON_WHITESPACE,
    JsonGrammarOptions,
)

_BACKENDS = ("auto", "guidance")
# vLLM keys paged cannot honour, with the value that means "off" (accepted as such).
_UNSUPPORTED_DEFAULTS: dict[str, object] = {
    "reasoning_parser_plugin": "",
}
_KNOWN = {
    "backend",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "compile_timeout_s",
    "cache_size",
    "max_json_whitespace",
    "reasoning_parser",
    "enable_in_reasoning",
    *_UNSUPPORTED_DEFAULTS,
}


@dataclass(frozen=True, slots=True)
class StructuredOutputOptions:
    """Engine-wide structured-output settings (from `--structured-outputs-config`)."""

    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    cache_size: int = DEFAULT_CACHE_SIZE
    json_options: JsonGrammarOptions = field(default_factory=JsonGrammarOptions)
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {self.compile_timeout_s}")
        if self.cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {self.cache_size}")


def parse_structured_outputs_config(text: str | dict[str, Any]) -> StructuredOutputOptions:
    """The options in `text` (JSON object text or a dict); ValueError naming the bad key."""
    raw = json.loads(text) if isinstance(text, str) else dict(text)
    if not isinstance(raw, dict):
        raise ValueError("--structured-outputs-config must be a JSON object")
    unknown = sorted(set(raw) - _KNOWN)
    if unknown:
        raise ValueError(f"--structured-outputs-config: unknown keys {unknown}")
    backend = raw.get("backend", "auto")
    if backend not in _BACKENDS:
        raise ValueError(
            f"structured outputs backend {backend!r} is not available: paged uses llguidance "
            f"(choose from {', '.join(_BACKENDS)})"
        )
    refused = sorted(k for k, off in _UNSUPPORTED_DEFAULTS.items() if k in raw and raw[k] != off)
    if refused:
        raise ValueError(
            f"--structured-outputs-config: not supported by paged (no parser plugins): {refused}"
        )
    bools = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
    for name in (*bools, "enable_in_reasoning"):
        if not isinstance(raw.get(name, False), bool):
            raise ValueError(f"--structured-outputs-config: {name} must be true or false")
    timeout = raw.get("compile_timeout_s", DEFAULT_COMPILE_TIMEOUT_S)
    cache = raw.get("cache_size", DEFAULT_CACHE_SIZE)
    whitespace = raw.get("max_json_whitespace", DEFAULT_MAX_JSON_WHITESPACE)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool):
        raise ValueError("compile_timeout_s must be a number of seconds")
    if not isinstance(cache, int) or isinstance(cache, bool):
        raise ValueError("cache_size must be an integer")
    if whitespace is not None and (not isinstance(whitespace, int) or isinstance(whitespace, bool)):
        raise ValueError("max_json_whitespace must be an integer >= 0 or null")
    parser = raw.get("reasoning_parser", "")
    if not isinstance(parser, str):
        raise ValueError("--structured-outputs-config: reasoning_parser must be a string")
    try:
        parser_name = check_reasoning_parser(parser)
    except ValueError as e:
        raise ValueError(f"--structured-outputs-config: {e}") from None
    return StructuredOutputOptions(
        reasoning_parser=parser_name,
        enable_in_reasoning=raw.get("enable_in_reasoning", False),
        compile_timeout_s=float(timeout),
        cache_size=cache,
        json_options=JsonGrammarOptions(
            disable_any_whitespace=raw.get("disable_any_whitespace", False),
            disable_additional_properties=raw.get("disable_additional_properties", False),
            max_json_whitespace=whitespace,
        ),
    )
