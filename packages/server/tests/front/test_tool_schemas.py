"""Tool request checks and the JSON schemas a tool choice constrains the output to."""

from __future__ import annotations

import json
from typing import Any

import pytest

from paged.server.errors import InvalidRequestError
from paged.server.openai.tools import (
    AUTO_NEEDS_FLAGS,
    ResolvedToolConfig,
    ToolCallingConfig,
    parse_tool_request,
    structured_json,
    template_tools,
    tool_json_schema,
)

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city"],
    "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}},
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "now"}},
]
AUTO = ResolvedToolConfig(auto_parser="hermes")


def test_required_schema_is_vllms_array_of_name_and_parameters() -> None:
    req = parse_tool_request(TOOLS, "required", None, ResolvedToolConfig())
    params_without_defs = {k: v for k, v in WEATHER_PARAMS.items() if k != "$defs"}
    assert tool_json_schema(req) == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": params_without_defs,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                },
            ],
        },
        "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}},
    }
    assert "$defs" in WEATHER_PARAMS  # the request's own schema is left as sent
    assert json.loads(structured_json(req) or "") == tool_json_schema(req)


def test_named_schema_is_the_functions_parameters() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_json_schema(parse_tool_request(TOOLS, choice, None, AUTO)) == WEATHER_PARAMS
    choice = {"type": "function", "function": {"name": "get_time"}}
    assert tool_json_schema(parse_tool_request(TOOLS, choice, None, AUTO)) == {
        "type": "object",
        "properties": {},
    }


def test_auto_and_none_have_no_schema() -> None:
    assert tool_json_schema(parse_tool_request(TOOLS, "auto", None, AUTO)) is None
    assert tool_json_schema(parse_tool_request(TOOLS, "none", None, AUTO)) is None
    assert parse_tool_request(None, None, None, AUTO) is None


def test_defaults_follow_vllm() -> None:
    req = parse_tool_request(TOOLS, None, None, AUTO)
    assert req is not None and req.mode == "auto" and req.parallel_tool_calls
    req = parse_tool_request(TOOLS, "auto", False, AUTO)
    assert req is not None and not req.parallel_tool_calls
    req = parse_tool_request([], "required", None, AUTO)  # OpenAI: like "none"
    assert req is not None and req.mode == "none"


def test_tools_reach_the_template_unless_excluded_for_none() -> None:
    req = parse_tool_request(TOOLS, "none", None, AUTO)
    shown = template_tools(req, AUTO)
    assert [t["function"]["name"] for t in shown] == ["get_weather", "get_time"]
    assert shown[1] == {
        "type": "function",
        "function": {"name": "get_time", "description": "now", "parameters": None, "strict": None},
    }
    excluded = ResolvedToolConfig("hermes", exclude_tools_when_tool_choice_none=True)
    assert template_tools(req, excluded) == []
    assert len(template_tools(parse_tool_request(TOOLS, "auto", None, excluded), excluded)) == 2


BAD: list[tuple[Any, Any, ResolvedToolConfig, str, str]] = [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, AUTO, "tool_choice", "nope"),
    (TOOLS, {"type": "function"}, AUTO, "tool_choice", "Correct usage"),
    (TOOLS, "sometimes", AUTO, "tool_choice", "Invalid value for `tool_choice`"),
    (None, "required", AUTO, "tool_choice", "`tools` must be set"),
    (None, {"type": "function", "function": {"name": "f"}}, AUTO, "tool_choice", "must be set"),
    (TOOLS, "auto", ResolvedToolConfig(), "tool_choice", AUTO_NEEDS_FLAGS),
    (TOOLS, None, ResolvedToolConfig(), "tool_choice", AUTO_NEEDS_FLAGS),
    ([{"type": "retrieval"}], "none", AUTO, "tools[0].type", "function"),
    ([{"type": "function"}], "none", AUTO, "tools[0].function", "object"),
    (
        [{"type": "function", "function": {"name": ""}}],
        "none",
        AUTO,
        "tools[0].function.name",
        "non-empty",
    ),
    (
        [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
        "none",
        AUTO,
        "tools[0].function.parameters",
        "schema",
    ),
]


@pytest.mark.parametrize(("tools", "choice", "config", "param", "message"), BAD)
def test_bad_tool_fields_name_the_field(
    tools: Any, choice: Any, config: ResolvedToolConfig, param: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_tool_request(tools, choice, None, config)
    assert info.value.param == param and message in info.value.message


def test_tool_choice_none_without_tools_is_allowed() -> None:
    req = parse_tool_request(None, "none", None, AUTO)
    assert req is not None and req.mode == "none" and req.tools == []


def test_conflicting_defs_are_a_400() -> None:
    other = {**WEATHER_PARAMS, "$defs": {"Unit": {"type": "integer"}}}
    tools = [*TOOLS, {"type": "function", "function": {"name": "g", "parameters": other}}]
    with pytest.raises(InvalidRequestError, match="multiple schemas"):
        tool_json_schema(parse_tool_request(tools, "required", None, AUTO))


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ToolCallingConfig(enable_auto_tool_choice=True).resolve(None)
    assert ToolCallingConfig(True, "auto").resolve("<tool_call>").auto_parser == "hermes"
    # A parser without --enable-auto-tool-choice still leaves "auto" refused, as vLLM.
    assert ToolCallingConfig(False, "hermes").resolve(None).auto_parser is None
