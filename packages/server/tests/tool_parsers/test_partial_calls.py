"""Tool-call arguments streamed while the model writes them (the pieces add up exactly)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ParserStreamer,
    RequiredArrayParser,
    ToolParser,
)
from paged.server.tool_parsers.partial_json import PartialCall, stable_json_prefix

ARGS = {"city": 'Paris "15e" é', "days": 3, "units": ["c", None], "x": 1.5, "ok": True}


def _raw(args: dict[str, Any]) -> str:
    """Arguments as a model might write them: odd spacing, escapes where dumps has none."""
    return json.dumps(args, indent=1, ensure_ascii=True).replace(": ", " :  ")


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (
            HermesToolParser(),
            f'ok <tool_call>{{"name": "get", "arguments": {_raw(ARGS)}}}</tool_call>',
        ),
        (Llama3JsonToolParser(), f'{{"name": "get", "parameters": {_raw(ARGS)}}}'),
        (RequiredArrayParser(), f'[{{"name": "get", "parameters": {_raw(ARGS)}}}]'),
    ],
)
def test_arguments_arrive_token_by_token_and_add_up(parser: ToolParser, text: str) -> None:
    streamer = ParserStreamer(parser)
    deltas = []
    for ch in text:  # one character per "token"
        deltas.extend(streamer.feed(ch, final=False).tool_calls)
    deltas.extend(streamer.feed("", final=True).tool_calls)
    assert deltas[0].name == "get" and deltas[0].id and deltas[0].arguments == ""
    pieces = [d.arguments for d in deltas[1:]]
    assert all(d.id is None and d.name is None and d.index == 0 for d in deltas[1:])
    assert len([p for p in pieces if p]) > 10  # many pieces, not one at the end
    assert "".join(pieces) == parser.extract(text).calls[0].arguments
    assert json.loads("".join(pieces)) == ARGS


def test_the_name_is_sent_before_the_arguments_are_complete() -> None:
    streamer = ParserStreamer(HermesToolParser())
    assert streamer.feed('<tool_call>{"name": "get_weather", "argu', False).tool_calls == []
    update = streamer.feed('ments": {"city": "Pa', False)
    assert [(d.name, d.arguments) for d in update.tool_calls] == [
        ("get_weather", ""),
        (None, '{"city": "Pa'),
    ]
    assert streamer.tools_called
    rest = streamer.feed('ris"}}</tool_call>', True).tool_calls
    assert "".join(d.arguments for d in rest) == 'ris"}' and all(d.id is None for d in rest)


@pytest.mark.parametrize(
    ("raw", "stable"),
    [
        ('{ "a" :1', '{"a": '),  # the number may go on
        ('{"a": 10,', '{"a": 10, '),
        ('{"a": "\\u00e', '{"a": "'),  # a partial escape waits
        ('{"a": "\\u00e9\\n', '{"a": "é\\n'),
        ('{"a": "\\ud83d\\ude00"}', '{"a": "\U0001f600"}'),
        ('{"a": [1.50, tru', '{"a": [1.5, '),
        ('{"a": {}} trailing', '{"a": {}}'),
    ],
)
def test_stable_prefix(raw: str, stable: str) -> None:
    assert stable_json_prefix(raw) == stable


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(-1e3, 1e3) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=5), JSON, max_size=4), st.booleans(), st.integers(0, 2))
def test_every_prefix_is_a_prefix_of_the_final_arguments(
    args: dict[str, Any], ascii_only: bool, indent: int
) -> None:
    raw = json.dumps(args, ensure_ascii=ascii_only, indent=indent or None)
    final = json.dumps(json.loads(raw), ensure_ascii=False)
    assert stable_json_prefix(raw) == final
    for i in range(len(raw)):
        assert final.startswith(stable_json_prefix(raw[:i])), raw[:i]


def test_partial_call_needs_the_name_first() -> None:
    hermes = HermesToolParser()
    assert hermes.partial_call('<tool_call>{"arguments": {"a": 1}, "name": "f"') is None
    assert hermes.partial_call('<tool_call>{"name": "f", "arguments": {"a"') == PartialCall(
        "f", '{"a"'
    )
    assert hermes.partial_call('<tool_call>{"name": "f", "arguments": {}}</tool_call>') is None
