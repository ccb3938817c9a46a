"""`--structured-outputs-config` (vLLM's flag): JSON text -> `StructuredOutputOptions`.

vLLM's keys are read with vLLM's meaning where paged can honour them and refused
by name where it cannot (never silently ignored):

    backend                "auto" or "guidance" (llguidance is paged's only backend)
    disable_fallback       accepted; there is no other backend to fall back to
    disable_any_whitespace, disable_additional_properties, reasoning_parser,
    enable_in_reasoning    refused (set per request, or not supported)

paged's own: `compile_timeout_s` (wall-clock bound of one grammar compile; past
it the request is a 400) and `cache_size` (compiled grammars kept).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from paged.server.structured_output.defaults import DEFAULT_CACHE_SIZE, DEFAULT_COMPILE_TIMEOUT_S

_BACKENDS = ("auto", "guidance")
_REFUSED = (
    "disable_any_whitespace",
    "disable_additional_properties",
    "reasoning_parser",
    "enable_in_reasoning",
)


@dataclass(frozen=True, slots=True)
class StructuredOutputOptions:
    """Engine-wide structured-output settings (from `--structured-outputs-config`)."""

    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    cache_size: int = DEFAULT_CACHE_SIZE

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
    backend = raw.pop("backend", "auto")
    if backend not in _BACKENDS:
        raise ValueError(
            f"structured outputs backend {backend!r} is not available: paged uses llguidance "
            f"(choose from {', '.join(_BACKENDS)})"
        )
    raw.pop("disable_fallback", None)
    refused = sorted(k for k in raw if k in _REFUSED)
    if refused:
        raise ValueError(f"--structured-outputs-config: not supported by paged: {refused}")
    unknown = sorted(set(raw) - {"compile_timeout_s", "cache_size"})
    if unknown:
        raise ValueError(f"--structured-outputs-config: unknown keys {unknown}")
    timeout = raw.get("compile_timeout_s", DEFAULT_COMPILE_TIMEOUT_S)
    cache = raw.get("cache_size", DEFAULT_CACHE_SIZE)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool):
        raise ValueError("compile_timeout_s must be a number of seconds")
    if not isinstance(cache, int) or isinstance(cache, bool):
        raise ValueError("cache_size must be an integer")
    return StructuredOutputOptions(compile_timeout_s=float(timeout), cache_size=cache)
