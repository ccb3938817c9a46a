"""Tool-call parsers: model output -> OpenAI `tool_calls` (vLLM's `--tool-call-parser`)."""

from __future__ import annotations

from paged.server.tool_parsers.base import (
    Content,
    ExtractedToolCalls,
    ParsedCall,
    Segment,
    ToolParser,
)
from paged.server.tool_parsers.generic import GenericToolParser
from paged.server.tool_parsers.hermes import HermesToolParser
from paged.server.tool_parsers.llama3_json import Llama3JsonToolParser
from paged.server.tool_parsers.mistral import MistralToolParser
from paged.server.tool_parsers.pythonic import PythonicToolParser
from paged.server.tool_parsers.registry import (
    TOOL_CALL_PARSERS,
    get_tool_parser,
    resolve_tool_parser_name,
)
from paged.server.tool_parsers.required import RequiredArrayParser
from paged.server.tool_parsers.streaming import (
    NamedToolStreamer,
    ParserStreamer,
    StreamUpdate,
    ToolCallDelta,
    ToolStreamer,
    make_tool_call_id,
)

__all__ = [
    "TOOL_CALL_PARSERS",
    "Content",
    "ExtractedToolCalls",
    "GenericToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolStreamer",
    "ParsedCall",
    "ParserStreamer",
    "PythonicToolParser",
    "RequiredArrayParser",
    "Segment",
    "StreamUpdate",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamer",
    "get_tool_parser",
    "make_tool_call_id",
    "resolve_tool_parser_name",
]
