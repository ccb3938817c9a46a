"""Responses `tools` / `tool_choice` -> the chat endpoint's `ToolRequest`.

Responses tools are flat (`{"type": "function", "name", "description",
"parameters", "strict"}`) and a named choice is `{"type": "function", "name"}`;
both are checked here (400 naming `tools[i].name`, `tool_choice`) with vLLM
0.33's wording (responses/protocol.py:826-861, check_tool_usage), converted to
the chat shapes (vLLM's convert_tool_responses_to_completions_format,
utils.py:489-501) and handed to `paged.server.openai.tools`, so rendering,
constraining ("required", named) and parsing are the chat endpoint's own.

`"auto"` is the Responses default, so unlike chat it is never a 400: without
`--enable-auto-tool-choice` the tools still reach the template and the output
is returned as a message, unparsed, as vLLM 0.33 does without a tool parser
(parser/abstract_parser.py:397-399).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged.server.errors import InvalidRequestError
from paged.server.openai import tools as chat_tools
from paged.server.openai.tool_types import ToolRequest
from paged.server.openai.tools import ResolvedToolConfig


@dataclass(frozen=True, slots=True)
class ResponsesTools:
    """What the handler needs: the parsed request (None: no tools) and the template's tools."""

    request: ToolRequest | None
    template_tools: list[dict[str, Any]]


def _chat_tool(tool: object, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise InvalidRequestError(where, f"{where} must be an object")
    if tool.get("type") != "function":
        raise InvalidRequestError(
            f"{where}.type", f"only 'function' tools are supported; got {tool.get('type')!r}"
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.name", f"{where}.name must be a non-empty string")
    fn = {k: v for k, v in tool.items() if k != "type"}
    return {"type": "function", "function": fn}


def _chat_choice(choice: str | dict[str, Any], names: set[str]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if not names and choice == "required":
            raise InvalidRequestError(
                "tool_choice", "Tool choice 'required' must be specified with 'tools' parameter."
            )
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str) or name not in names:
        raise InvalidRequestError(
            "tool_choice", "Tool choice 'function' not found in 'tools' parameter."
        )
    return {"type": "function", "function": {"name": name}}


def resolve_tools(
    raw_tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any],
    parallel_tool_calls: bool | None,
    config: ResolvedToolConfig,
) -> ResponsesTools:
    chat = [_chat_tool(t, i) for i, t in enumerate(raw_tools)]
    names = {t["function"]["name"] for t in chat}
    choice = _chat_choice(tool_choice, names)
    if not chat:
        return ResponsesTools(None, [])  # vLLM: no tools means tool_choice "none"
    unparsed_auto = choice == "auto" and config.auto_parser is None
    try:
        req = chat_tools.parse_tool_request(
            chat, "none" if unparsed_auto else choice, parallel_tool_calls, config
        )
    except InvalidRequestError as e:
        # The chat checks name `tools[i].function.x`; Responses tools are flat.
        param = e.param.replace(".function.", ".") if e.param else e.param
        raise InvalidRequestError(param, e.message, e.code) from None
    assert req is not None  # tools were given
    if unparsed_auto:
        # Shown to the template whatever --exclude-tools-when-tool-choice-none says.
        return ResponsesTools(req, [t.template_dict() for t in req.tools])
    return ResponsesTools(req, chat_tools.template_tools(req, config))
