"""Responses building blocks: output items, the stream state machine (reasoning included),
input conversion and the store switch."""

from __future__ import annotations

from typing import Any

import pytest

from paged.server.errors import InvalidRequestError
from paged.server.openai.responses.inputs import input_messages
from paged.server.openai.responses.output import StreamItems, build_output_items
from paged.server.openai.responses.protocol import (
    FunctionToolCall,
    OutputMessage,
    OutputText,
    ReasoningItem,
)
from paged.server.openai.responses.store import ENV_VAR, store_enabled_from_env
from paged.server.tool_parsers import ParsedCall


def test_build_output_items_order_and_statuses() -> None:
    calls = [ParsedCall("a", "{}"), ParsedCall("b", '{"x": 1}')]
    items = build_output_items("think", "text", calls, "length")
    assert [i.type for i in items] == ["reasoning", "message", "function_call", "function_call"]
    # Only the last item was cut by the token limit (vLLM's build_response_output_items).
    assert [i.status for i in items] == [None, "completed", "completed", "incomplete"]
    assert isinstance(items[0], ReasoningItem) and items[0].content is not None
    assert items[0].content[0].text == "think" and items[0].id.startswith("rs_")
    assert isinstance(items[3], FunctionToolCall) and items[3].arguments == '{"x": 1}'
    assert build_output_items(None, "", [], "stop") == []  # an empty message is left out
    (msg,) = build_output_items(None, "hi", [], "length")
    assert msg.status == "incomplete"


def test_stream_items_reasoning_then_text_then_calls() -> None:
    s = StreamItems()
    events = [
        *s.reasoning("th"),
        *s.reasoning("ink"),
        *s.content("Hel"),
        *s.content("lo"),
        *s.tool_call(0, '{"a"', "call_0", "f"),
        *s.tool_call(0, ": 1}"),
        *s.tool_call(1, "{}", "call_1", "g"),
        *s.close("completed"),
    ]
    assert [(e.type, getattr(e, "output_index", None)) for e in events] == [
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.output_item.added", 3),
        ("response.function_call_arguments.delta", 3),
        ("response.function_call_arguments.done", 3),
        ("response.output_item.done", 3),
    ]
    reasoning, message, call0, call1 = s.items
    assert isinstance(reasoning, ReasoningItem) and reasoning.content is not None
    assert reasoning.content[0].text == "think"
    assert isinstance(message, OutputMessage) and message.content == [OutputText(text="Hello")]
    assert isinstance(call0, FunctionToolCall) and isinstance(call1, FunctionToolCall)
    assert (call0.call_id, call0.name, call0.arguments) == ("call_0", "f", '{"a": 1}')
    assert (call1.call_id, call1.name, call1.arguments) == ("call_1", "g", "{}")
    assert s.close() == []  # nothing open any more


def test_stream_items_empty_pieces_open_nothing() -> None:
    s = StreamItems()
    assert s.content("") == [] and s.reasoning("") == [] and s.close("incomplete") == []
    assert s.items == []


def test_input_items_make_one_assistant_turn() -> None:
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
    ]
    messages = input_messages("sys", items)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    turn = messages[2]
    assert turn["reasoning"] == "hmm" and turn["content"] is None
    assert [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "r1"}
    assert messages[4] == {"role": "assistant", "content": "a"}


def test_previous_conversation_drops_its_instructions_keeps_calls() -> None:
    prev = [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}]
    output = [FunctionToolCall(id="fc_1", call_id="c1", name="f", arguments="{}")]
    out = [{"type": "function_call_output", "call_id": "c1", "output": "r"}]
    messages = input_messages(None, out, prev, output)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def test_encrypted_reasoning_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as e:
        input_messages(None, [{"type": "reasoning", "encrypted_content": "x", "summary": []}])
    assert e.value.param == "input[0]"


def test_store_switch_reads_the_env_as_vllm() -> None:
    assert store_enabled_from_env({}) is False
    assert store_enabled_from_env({ENV_VAR: "0"}) is False
    assert store_enabled_from_env({ENV_VAR: "1"}) is True
    with pytest.raises(ValueError, match=ENV_VAR):
        store_enabled_from_env({ENV_VAR: "yes"})
