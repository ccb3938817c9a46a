"""The generic format's parser: `{"tool_calls": [...]}` or `{"response": ...}` -> calls, content."""

from __future__ import annotations

import json

import pytest

from paged.server.tool_parsers import (
    TOOL_CALL_PARSERS,
    Content,
    GenericToolParser,
    ParsedCall,
    ParserStreamer,
)
from paged.server.tool_parsers.partial_json import PartialCall

CALLS = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},'
    ' {"name": "get_time", "arguments": {}}]}'
)
RESPONSE = '{"response": "Hi \\"you\\"\\n\\u00e9 \\ud83d\\ude00"}'
DECODED = 'Hi "you"\né \U0001f600'


def test_calls_are_read_into_tool_calls() -> None:
    result = GenericToolParser().extract(CALLS)
    assert result.content is None
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]


def test_response_is_the_decoded_content() -> None:
    result = GenericToolParser().extract(RESPONSE)
    assert result.calls == [] and result.content == DECODED


@pytest.mark.parametrize(
    "text",
    [
        "plain text, no JSON",
        '{"answer": "other key"}',
        '{"tool_calls": [{"arguments": {}}]}',  # a call without a name
        '{"tool_calls": "not an array"}',
    ],
)
def test_what_is_not_the_format_is_content_as_written(text: str) -> None:
    result = GenericToolParser().extract(text)
    assert result.calls == [] and result.content == text


def test_nothing_is_decided_while_the_key_is_still_being_written() -> None:
    parser = GenericToolParser()
    for prefix in ["", " ", "{", '{"', '{"tool', '{"res', '{ "response" :']:
        assert parser.split(prefix, final=False) == [], prefix
    assert parser.split('{"resp', final=False) == []
    assert parser.split('{"other', final=False) == [Content('{"other')]


def test_a_response_cut_short_keeps_what_was_written() -> None:
    parser = GenericToolParser()
    assert parser.split('{"response": "Hel', final=False) == [Content("Hel")]
    assert parser.split('{"response": "Hel\\u00', final=False) == [Content("Hel")]
    assert parser.extract('{"response": "Hello wor').content == "Hello wor"


def test_open_call_is_streamed_after_its_name() -> None:
    parser = GenericToolParser()
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"ci'
    assert parser.split(text, final=False) == []
    assert parser.partial_call(text) == PartialCall("get_weather", '{"ci')
    done = text + 'ty": "Paris"}}]}'
    assert parser.split(done, final=False) == [ParsedCall("get_weather", '{"city": "Paris"}')]


def test_generic_is_a_tool_call_parser_name() -> None:
    assert TOOL_CALL_PARSERS["generic"] is GenericToolParser


@pytest.mark.parametrize("text", [CALLS, RESPONSE, "not json at all", '{"response": "cut'])
def test_streamed_deltas_add_up_to_the_non_streaming_result(text: str) -> None:
    """Every split into two "tokens", and one character per token."""
    expected = GenericToolParser().extract(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        streamer = ParserStreamer(GenericToolParser())
        content = ""
        calls: dict[int, dict[str, str]] = {}
        for i, piece in enumerate(pieces):
            update = streamer.feed(piece, final=i == len(pieces) - 1)
            content += update.content
            for d in update.tool_calls:
                if d.id is not None:
                    assert d.name and d.arguments == ""
                    calls[d.index] = {"name": d.name, "arguments": ""}
                calls[d.index]["arguments"] += d.arguments
        assert content == (expected.content or ""), pieces
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.name, c.arguments) for c in expected.calls
        ], pieces
