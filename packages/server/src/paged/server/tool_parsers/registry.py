"""`--tool-call-parser` names -> parsers, and paged's `auto` pick from the chat template."""

from __future__ import annotations

from paged.server.tool_parsers.base import ToolParser
from paged.server.tool_parsers.generic import GenericToolParser
from paged.server.tool_parsers.hermes import START as HERMES_START
from paged.server.tool_parsers.hermes import HermesToolParser
from paged.server.tool_parsers.llama3_json import Llama3JsonToolParser
from paged.server.tool_parsers.mistral import BOT as MISTRAL_BOT
from paged.server.tool_parsers.mistral import MistralToolParser
from paged.server.tool_parsers.pythonic import PythonicToolParser

TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    # paged's own, after llama.cpp's: tools in the system turn, output constrained to JSON.
    "generic": GenericToolParser,
}
AUTO = "auto"  # paged's own: not a vLLM parser name
GENERIC = "generic"


def resolve_tool_parser_name(name: str, chat_template: str | None) -> str:
    """A parser name; `auto` picks one from what the chat template writes.

    Raises ValueError for an unknown name, or `auto` with a template that shows
    neither format (vLLM has no `auto`: it needs the parser named).
    """
    if name != AUTO:
        if name not in TOOL_CALL_PARSERS:
            known = ", ".join(sorted(TOOL_CALL_PARSERS))
            raise ValueError(f"invalid tool call parser: {name} (choose from {{{known}}})")
        return name
    template = chat_template or ""
    if HERMES_START in template:
        return "hermes"
    if MISTRAL_BOT in template:
        return "mistral"
    # Llama 3.x templates: header tokens, and the ipython role / python tag for tools.
    if "<|start_header_id|>" in template:
        return "llama3_json"
    raise ValueError(
        "--tool-call-parser auto: the chat template shows none of <tool_call> (hermes), "
        "[TOOL_CALLS] (mistral) or Llama 3 headers (llama3_json); name the parser"
    )


def get_tool_parser(name: str) -> ToolParser:
    return TOOL_CALL_PARSERS[name]()
