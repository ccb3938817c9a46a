"""The generic tool format's pieces: template detection, flags, schema, prompt, history."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from paged.server.errors import InvalidRequestError
from paged.server.openai.generic_tools import (
    ToolTemplateProbe,
    example_arguments,
    generic_messages,
    generic_tool_schema,
    template_ignores_tools,
    tool_system_text,
)
from paged.server.openai.tool_types import ToolRequest
from paged.server.openai.tools import (
    ResolvedToolConfig,
    ToolCallingConfig,
    parse_tool_request,
    parse_tools,
    resolve_for_tokenizer,
    structured_json,
)

from .conftest import CHAT_TEMPLATE

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}
TOOLS = parse_tools([WEATHER, TIME])
USES_TOOLS = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)
REFUSES_TOOLS = (
    "{% if tools %}{{ raise_exception('no tools') }}{% endif %}{{ messages[0].content }}"
)
GENERIC = ResolvedToolConfig("generic", generic=True)


def _req(mode: Any, named: str | None = None, parallel_asked: bool = False) -> ToolRequest:
    return ToolRequest(TOOLS, mode, named, True, parallel_asked)


# -- detection and flags ---------------------------------------------------------------


def test_template_that_ignores_tools_is_detected(tokenizer: Any) -> None:
    assert template_ignores_tools(tokenizer, CHAT_TEMPLATE)  # the tiny ChatML one
    assert not template_ignores_tools(tokenizer, USES_TOOLS)
    assert template_ignores_tools(tokenizer, REFUSES_TOOLS)  # fails with tools: shows none


def test_probe_remembers_each_template(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = ToolTemplateProbe(tokenizer, max_entries=1)
    assert probe.ignores_tools(CHAT_TEMPLATE)
    calls: list[str] = []
    original = tokenizer.apply_chat_template

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["chat_template"])
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counting)
    assert probe.ignores_tools(CHAT_TEMPLATE) and calls == []
    assert not probe.ignores_tools(USES_TOOLS) and len(calls) == 2
    assert probe.ignores_tools(CHAT_TEMPLATE) and len(calls) == 4  # evicted (one entry)


def test_default_flags_use_generic_only_where_the_template_ignores_tools(
    tokenizer: Any,
) -> None:
    config = resolve_for_tokenizer(ToolCallingConfig(), tokenizer)
    assert config.generic_when_ignored and not config.generic and config.auto_parser is None
    assert config.for_template(True).generic and config.for_template(True).auto_parser == "generic"
    assert config.for_template(False) is config  # vLLM's rule: "auto" is refused
    named = ToolCallingConfig(True, "hermes").resolve(None, template_ignores_tools=True)
    assert named.auto_parser == "hermes" and not named.for_template(True).generic


def test_generic_parser_flag_and_auto_pick(tokenizer: Any) -> None:
    explicit = ToolCallingConfig(False, "generic").resolve(USES_TOOLS)
    assert explicit.generic and explicit.auto_parser == "generic"  # no opt-in needed
    picked = resolve_for_tokenizer(ToolCallingConfig(True, "auto"), tokenizer)
    assert picked.generic  # the tiny template ignores tools
    with pytest.raises(ValueError, match="name the parser"):
        ToolCallingConfig(True, "auto").resolve(USES_TOOLS, template_ignores_tools=False)


def test_auto_is_accepted_in_the_generic_format() -> None:
    req = parse_tool_request([WEATHER], None, None, GENERIC)
    assert req is not None and req.mode == "auto"
    with pytest.raises(InvalidRequestError):
        parse_tool_request([WEATHER], None, None, ResolvedToolConfig())


# -- schema ------------------------------------------------------------------------------

CALL: dict[str, Any] = {
    "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]
}


def test_auto_schema_is_a_call_or_an_answer() -> None:
    schema = generic_tool_schema(_req("auto"))
    jsonschema.validate(CALL, schema)
    jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {}}]}, schema)
    jsonschema.validate({"response": "hello"}, schema)
    bad = [
        {"response": ""},  # an empty answer
        {"response": "x", "tool_calls": []},
        {"tool_calls": []},
        {"tool_calls": [CALL["tool_calls"][0]] * 2},  # one call unless parallel was asked
        {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]},  # unit
        {
            "tool_calls": [
                {"name": "get_weather", "arguments": {**CALL["tool_calls"][0]["arguments"], "x": 1}}
            ]
        },
        {"tool_calls": [{"name": "nope", "arguments": {}}]},
    ]
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)


def test_required_named_and_parallel_schemas() -> None:
    required = generic_tool_schema(_req("required"))
    jsonschema.validate(CALL, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"response": "hello"}, required)
    named = generic_tool_schema(_req("named", "get_time"))
    jsonschema.validate({"tool_calls": [{"name": "get_time", "arguments": {}}]}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(CALL, named)
    parallel = generic_tool_schema(_req("required", parallel_asked=True))
    jsonschema.validate({"tool_calls": [CALL["tool_calls"][0]] * 2}, parallel)


def test_parallel_asked_only_when_sent_true() -> None:
    assert not parse_tool_request([WEATHER], None, None, GENERIC).parallel_tool_calls_asked  # type: ignore[union-attr]
    asked = parse_tool_request([WEATHER], None, True, GENERIC)
    assert asked is not None and asked.parallel_tool_calls_asked


def test_defs_are_hoisted_and_auto_sends_a_schema_only_when_generic() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/P"}},
                "required": ["p"],
                "$defs": {"P": {"type": "integer"}},
            },
        },
    }
    req = parse_tool_request([tool], "auto", None, GENERIC)
    schema = json.loads(structured_json(req, GENERIC) or "")
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate({"tool_calls": [{"name": "f", "arguments": {"p": 3}}]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "f", "arguments": {"p": "x"}}]}, schema)
    hermes = ResolvedToolConfig("hermes")
    assert structured_json(parse_tool_request([tool], "auto", None, hermes), hermes) is None


# -- prompt and history --------------------------------------------------------------------


def test_example_arguments_follow_the_schema() -> None:
    assert example_arguments(TOOLS[0]) == {"city": "...", "unit": "c"}  # required only
    assert example_arguments(TOOLS[1]) == {}


def test_system_text_describes_tools_both_shapes_and_an_example() -> None:
    text = tool_system_text(_req("auto"))
    assert json.dumps(WEATHER["function"]["parameters"]) in text
    assert '"name": "get_time"' in text
    assert '{"response": "<your answer>"}' in text
    assert (
        'Example: {"tool_calls": [{"name": "get_weather", "arguments": '
        '{"city": "...", "unit": "c"}}]}' in text
    )
    required = tool_system_text(_req("required"))
    assert '"response"' not in required and "Reply by calling a tool" in required
    named = tool_system_text(_req("named", "get_time"))
    assert "get_weather" not in named and '"name": "get_time"' in named


def test_the_instruction_joins_the_system_message_or_opens_one() -> None:
    user = {"role": "user", "content": "hi"}
    merged = generic_messages([{"role": "system", "content": "Be brief."}, user], _req("auto"))
    assert merged[0]["role"] == "system" and merged[0]["content"].startswith("Be brief.\n\n")
    assert "You can call these tools:" in merged[0]["content"] and merged[1] == user
    opened = generic_messages([user], _req("auto"))
    assert opened[0]["role"] == "system" and opened[0]["content"].startswith("You can call")
    assert generic_messages([user], _req("none")) == [user]


def test_the_round_trip_renders_as_text_any_template_can_show() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    out = generic_messages(messages, None)
    assert out[1] == {
        "role": "assistant",
        "content": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
    }
    assert out[2] == {"role": "user", "content": "Result of get_weather: sunny, 21 C"}
    bad = [*messages[:1], {**messages[1], "tool_calls": [{"function": {"arguments": "{"}}]}]
    with pytest.raises(InvalidRequestError) as e:
        generic_messages(bad, None)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


def test_a_named_choice_is_one_call_even_with_parallel_calls_asked() -> None:
    # vLLM's named tool choice yields one call; the 135M model repeated it until
    # max_output_tokens through /v1/responses, whose parallel_tool_calls defaults to true.
    named = generic_tool_schema(_req("named", "get_weather", parallel_asked=True))
    one = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]}
    jsonschema.validate(one, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": one["tool_calls"] * 2}, named)
    auto = generic_tool_schema(_req("auto", parallel_asked=True))
    jsonschema.validate({"tool_calls": one["tool_calls"] * 2}, auto)  # asked: several allowed
