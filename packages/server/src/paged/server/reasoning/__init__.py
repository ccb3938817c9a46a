"""Reasoning models' split: `--reasoning-parser` parsers and the engine's grammar gate."""

from paged.server.reasoning.gate import ReasoningEndDetector, ReasoningGate
from paged.server.reasoning.parser import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningSpec,
    ReasoningStream,
)
from paged.server.reasoning.registry import (
    REASONING_EFFORTS,
    REASONING_SPECS,
    check_reasoning_parser,
    effort_template_kwargs,
    make_reasoning_parser,
    thinking_enabled,
)

__all__ = [
    "REASONING_EFFORTS",
    "REASONING_SPECS",
    "ReasoningDelta",
    "ReasoningEndDetector",
    "ReasoningGate",
    "ReasoningParser",
    "ReasoningSpec",
    "ReasoningStream",
    "check_reasoning_parser",
    "effort_template_kwargs",
    "make_reasoning_parser",
    "thinking_enabled",
]
