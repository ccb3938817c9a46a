"""Tool calling for /v1/chat/completions: request checks, schemas, parsing the output.

vLLM's semantics throughout: `tools` without `tool_choice` means `"auto"`;
`"auto"` needs `--enable-auto-tool-choice` (and a `--tool-call-parser`); `"none"`
still shows the tools to the chat template unless
`--exclude-tools-when-tool-choice-none`; `"required"` and a named function are
constrained with a JSON schema (`tool_json_schema`, vLLM's
`get_json_schema_from_tool`) through `SamplingParams.structured_outputs`, and
their output is read back as JSON, without a text parser. Nothing here enforces
that schema: the structured-output backend does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from paged.server.chat_utils import FALLBACK_CHAT_TEMPLATE
from paged.server.errors import InvalidRequestError
from paged.server.openai.generic_tools import generic_tool_schema, template_ignores_tools
from paged.server.openai.protocol import (
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from paged.server.openai.tool_types import ChoiceMode, FunctionTool, ToolRequest, hoist_defs
from paged.server.tokenizer import TokenizerLike
from paged.server.tool_parsers import (
    ExtractedToolCalls,
    GenericToolParser,
    NamedToolStreamer,
    ParsedCall,
    ParserStreamer,
    RequiredArrayParser,
    StreamUpdate,
    ToolParser,
    ToolStreamer,
    get_tool_parser,
    make_tool_call_id,
    resolve_tool_parser_name,
)
from paged.server.tool_parsers.registry import AUTO, GENERIC

AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)
_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass(frozen=True, slots=True)
class ToolCallingConfig:
    """The server's tool-calling flags (vLLM's names); `tool_call_parser` as given."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False

    def resolve(
        self, chat_template: str | None, template_ignores_tools: bool = False
    ) -> ResolvedToolConfig:
        """Check the flags once at start-up (ValueError, as vLLM's start-up checks).

        `template_ignores_tools`: the server's chat template does not render `tools`;
        then `--tool-call-parser auto` picks the generic format.
        """
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        parser = self.tool_call_parser
        if parser is None:
            # No parser named: where the template ignores tools, the generic format
            # (decided per request, for the template that request renders with).
            return ResolvedToolConfig(
                exclude_tools_when_tool_choice_none=self.exclude_tools_when_tool_choice_none,
                generic_when_ignored=True,
            )
        if parser == GENERIC or (parser == AUTO and template_ignores_tools):
            name = GENERIC
        else:
            name = resolve_tool_parser_name(parser, chat_template)
        return ResolvedToolConfig(
            # The generic format's output is grammar-constrained, so it always parses:
            # "auto" needs no opt-in there (see docs/tool-calling.md).
            auto_parser=name if self.enable_auto_tool_choice or name == GENERIC else None,
            exclude_tools_when_tool_choice_none=self.exclude_tools_when_tool_choice_none,
            generic=name == GENERIC,
        )


def resolve_for_tokenizer(
    config: ToolCallingConfig, tokenizer: TokenizerLike
) -> ResolvedToolConfig:
    """`config.resolve` against the tokenizer's chat template (rendered once to see
    whether it reads `tools`); ValueError for flags that do not fit."""
    template = getattr(tokenizer, "chat_template", None)
    ignores = template_ignores_tools(tokenizer, template or FALLBACK_CHAT_TEMPLATE)
    return config.resolve(template, template_ignores_tools=ignores)


@dataclass(frozen=True, slots=True)
class ResolvedToolConfig:
    """The flags as one request uses them.

    `generic`: the generic format (tools in the system turn, output constrained to
    `{"tool_calls": ...}` / `{"response": ...}`) for every tool choice.
    `generic_when_ignored`: no parser was named; `for_template` switches to the
    generic format when the request's chat template ignores `tools`.
    """

    auto_parser: str | None = None  # None: `tool_choice: "auto"` is refused
    exclude_tools_when_tool_choice_none: bool = False
    generic: bool = False
    generic_when_ignored: bool = False

    def for_template(self, ignores_tools: bool) -> ResolvedToolConfig:
        if self.generic_when_ignored and ignores_tools:
            return ResolvedToolConfig(
                GENERIC, self.exclude_tools_when_tool_choice_none, generic=True
            )
        return self


def _req_str(value: Any, param: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or (not optional and not value):
        raise InvalidRequestError(param, f"{param} must be a non-empty string")
    return value


def parse_tools(raw: list[dict[str, Any]]) -> list[FunctionTool]:
    """OpenAI function tools, checked field by field (400 naming the field)."""
    tools: list[FunctionTool] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"{where}.type", f"only 'function' tools are supported; got {tool.get('type')!r}"
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"{where}.function", f"{where}.function must be an object")
        name = _req_str(fn.get("name"), f"{where}.function.name")
        description = _req_str(fn.get("description"), f"{where}.function.description", True)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(
                f"{where}.function.parameters", "parameters must be a JSON schema object"
            )
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{where}.function.strict", "strict must be a boolean")
        assert name is not None  # _req_str raised otherwise
        tools.append(FunctionTool(name, description, params, strict))
    return tools


def _named_choice(choice: dict[str, Any], tools: list[FunctionTool]) -> str:
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict):
        raise InvalidRequestError(
            "tool_choice", f"Invalid value for `tool_choice`: {choice}! {_NAMED_USAGE}"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            "tool_choice", f"Invalid `name` in `function` in `tool_choice`! {_NAMED_USAGE}"
        )
    if name not in {t.name for t in tools}:
        raise InvalidRequestError(
            "tool_choice",
            f"The tool specified in `tool_choice` ({name!r}) does not match any of the "
            "specified `tools`",
        )
    return name


def parse_tool_request(
    raw_tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    config: ResolvedToolConfig,
) -> ToolRequest | None:
    """The request's tool fields as vLLM checks them; None when tools play no part."""
    tools = parse_tools(raw_tools) if raw_tools is not None else None
    if tool_choice is None:
        if not tools:
            return None
        tool_choice = "auto"  # vLLM's (and OpenAI's) default when tools are given
    if tool_choice != "none" and tools is None:
        raise InvalidRequestError("tool_choice", "When using `tool_choice`, `tools` must be set.")
    parallel = parallel_tool_calls is not False
    asked = parallel_tool_calls is True
    if isinstance(tool_choice, dict):
        name = _named_choice(tool_choice, tools or [])
        return ToolRequest(tools or [], "named", name, parallel, asked)
    if tool_choice not in ("none", "auto", "required"):
        raise InvalidRequestError(
            "tool_choice",
            f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, "
            '"none", "auto" or "required" are supported.',
        )
    if tool_choice == "required" and not tools:
        tool_choice = "none"  # OpenAI: "required" with no tools behaves like "none"
    if tool_choice == "auto" and config.auto_parser is None:
        raise InvalidRequestError("tool_choice", AUTO_NEEDS_FLAGS)
    modes: dict[str, ChoiceMode] = {"none": "none", "auto": "auto", "required": "required"}
    return ToolRequest(tools or [], modes[tool_choice], None, parallel, asked)


def template_tools(req: ToolRequest | None, config: ResolvedToolConfig) -> list[dict[str, Any]]:
    """The tools the chat template receives (vLLM: none only with the exclude flag)."""
    if req is None or not req.tools or config.generic:
        return []  # generic: the tools are described in the system turn instead
    if req.mode == "none" and config.exclude_tools_when_tool_choice_none:
        return []
    return [t.template_dict() for t in req.tools]


# -- schemas (vLLM's get_json_schema_from_tool) ------------------------------------------


def _tool_item_schema(tool: FunctionTool) -> dict[str, Any]:
    # Missing parameters are written as `{}` in the output, so the schema asks for
    # an empty object then (as vLLM's `_get_tool_schema`).
    params = tool.parameters or {"type": "object", "properties": {}}
    return {
        "properties": {
            "name": {"type": "string", "enum": [tool.name]},
            "parameters": params,
        },
        "required": ["name", "parameters"],
        # Unlike vLLM: no keys beside name and parameters, which the call drops anyway;
        # a weak model could otherwise fill max_tokens with them and never close the array.
        "additionalProperties": False,
    }


def tool_json_schema(
    req: ToolRequest | None, config: ResolvedToolConfig | None = None
) -> dict[str, Any] | None:
    """The JSON schema the output must follow; None for "none" and (not generic) "auto".

    Generic format: `generic_tool_schema`, for "auto" too.

    Named: that function's `parameters` (the output *is* the arguments object).
    "required": an array of at least one `{"name": <that tool>, "parameters": <its
    schema>}`, one `anyOf` branch per tool.
    """
    if req is None or req.mode == "none" or (req.mode == "auto" and not _generic(config)):
        return None
    if _generic(config):
        return generic_tool_schema(req)
    if req.mode == "named":
        tool = next(t for t in req.tools if t.name == req.named)
        return tool.parameters or {"type": "object", "properties": {}}
    tools, defs = hoist_defs(req.tools)
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [_tool_item_schema(t) for t in tools]},
    }
    if defs:
        schema["$defs"] = defs
    return schema


def _generic(config: ResolvedToolConfig | None) -> bool:
    return config is not None and config.generic


def structured_json(
    req: ToolRequest | None, config: ResolvedToolConfig | None = None
) -> str | None:
    """`tool_json_schema` as the JSON text `StructuredOutputsParams.json` takes."""
    schema = tool_json_schema(req, config)
    return None if schema is None else json.dumps(schema, ensure_ascii=False)


# -- reading the output ---------------------------------------------------------------


def output_parser(req: ToolRequest | None, config: ResolvedToolConfig) -> ToolParser | None:
    """The parser for this request's output; None when the output is plain content."""
    if req is None or req.mode == "none":
        return None
    if config.generic:
        return GenericToolParser()
    if req.mode == "named":
        return None
    if req.mode == "required":
        return RequiredArrayParser()
    assert config.auto_parser is not None  # parse_tool_request refused "auto" otherwise
    return get_tool_parser(config.auto_parser)


def extract(req: ToolRequest | None, config: ResolvedToolConfig, text: str) -> ExtractedToolCalls:
    """A whole output -> calls and content (non-streaming)."""
    if req is not None and req.mode == "named" and not config.generic:
        assert req.named is not None
        # vLLM: the raw output is the arguments, as the schema made it.
        return ExtractedToolCalls([ParsedCall(req.named, text)], None)
    parser = output_parser(req, config)
    if parser is None:
        return ExtractedToolCalls([], text)
    result = parser.extract(text)
    if not req or req.parallel_tool_calls or len(result.calls) <= 1:
        return result
    return ExtractedToolCalls(result.calls[:1], result.content)  # vLLM keeps the first


def streamer(req: ToolRequest | None, config: ResolvedToolConfig) -> ToolStreamer | None:
    """A per-choice streamer, or None when the output streams as plain content."""
    if req is not None and req.mode == "named" and not config.generic:
        assert req.named is not None
        return NamedToolStreamer(req.named)
    parser = output_parser(req, config)
    return None if parser is None else ParserStreamer(parser)


def finish_reason(req: ToolRequest | None, tools_called: bool, reason: str | None) -> str | None:
    """vLLM: `tool_calls` once calls were parsed (a named choice keeps its reason)."""
    if tools_called and req is not None and req.mode in ("auto", "required"):
        return "tool_calls"
    return reason


# -- response shapes ------------------------------------------------------------------


def chat_message(
    req: ToolRequest | None, config: ResolvedToolConfig, text: str, reason: str | None
) -> tuple[ChatMessage, str | None]:
    """One choice's message and finish_reason for a non-streaming response."""
    result = extract(req, config, text)
    calls = [
        ToolCall(id=make_tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in result.calls
    ]
    message = ChatMessage(role="assistant", content=result.content, tool_calls=calls or None)
    return message, finish_reason(req, bool(calls), reason)


def delta_messages(req: ToolRequest | None, update: StreamUpdate) -> list[DeltaMessage]:
    """A stream update as deltas, one chunk each: the content, then each tool-call delta.

    OpenAI sends a call's id/type/name and its arguments in separate chunks; with
    `parallel_tool_calls: false` only the first call's deltas are sent (vLLM).
    """
    parallel = req is None or req.parallel_tool_calls
    out = [DeltaMessage(content=update.content)] if update.content else []
    for d in update.tool_calls:
        if not parallel and d.index != 0:
            continue
        fn = DeltaFunctionCall(name=d.name, arguments=d.arguments)
        call = DeltaToolCall(
            index=d.index, id=d.id, type="function" if d.id is not None else None, function=fn
        )
        out.append(DeltaMessage(tool_calls=[call]))
    return out
