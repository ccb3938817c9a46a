"""vLLM's `mistral` and `pythonic` tool-call formats: whole outputs and streams split anywhere."""

from __future__ import annotations

import json

import pytest

from paged.server.tool_parsers import (
    ExtractedToolCalls,
    MistralToolParser,
    ParsedCall,
    ParserStreamer,
    PythonicToolParser,
    ToolParser,
    resolve_tool_parser_name,
)


def call(name: str, **args: object) -> ParsedCall:
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


MISTRAL = MistralToolParser()
PYTHONIC = PythonicToolParser()

CASES: list[tuple[ToolParser, str, list[ParsedCall], str | None]] = [
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        [call("get_weather", city="Paris"), call("get_time")],
        None,
    ),
    (
        MISTRAL,
        'Let me check. [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        [call("get_weather", city="Paris"), call("get_time")],
        "Let me check. ",
    ),
    (MISTRAL, "No tools needed [TOOL", [], "No tools needed [TOOL"),
    (MISTRAL, '[TOOL_CALLS]get_weather{"city": ', [], '[TOOL_CALLS]get_weather{"city": '),
    (MISTRAL, "[TOOL_CALLS][1, 2]", [], "[TOOL_CALLS][1, 2]"),
    (
        PYTHONIC,
        "[get_weather(city='San Francisco', units=['c', None]), get_time()]",
        [call("get_weather", city="San Francisco", units=["c", None]), call("get_time")],
        None,
    ),
    (
        PYTHONIC,
        '<|python_start|>[f(x=1, y={"a": True})]<|python_end|>',
        [call("f", x=1, y={"a": True})],
        None,
    ),
    (PYTHONIC, "The answer is 4.", [], "The answer is 4."),
    (PYTHONIC, "[1, 2, 3]", [], "[1, 2, 3]"),
    (PYTHONIC, "[f(open('x'))]", [], "[f(open('x'))]"),  # positional: not a call form
    (PYTHONIC, "[f(x=__import__('os'))]", [], "[f(x=__import__('os'))]"),  # never evaluated
    (PYTHONIC, "[f(x=1)", [], "[f(x=1)"),
]


@pytest.mark.parametrize(("parser", "text", "calls", "content"), CASES)
def test_extract(
    parser: ToolParser, text: str, calls: list[ParsedCall], content: str | None
) -> None:
    assert parser.extract(text) == ExtractedToolCalls(calls, content)


@pytest.mark.parametrize(("parser", "text", "calls", "content"), CASES)
def test_stream_split_anywhere_matches_extract(
    parser: ToolParser, text: str, calls: list[ParsedCall], content: str | None
) -> None:
    for cut in range(len(text) + 1):
        st = ParserStreamer(parser)
        got_content = ""
        names: dict[int, str] = {}
        args: dict[int, str] = {}
        for piece, final in ((text[:cut], False), (text[cut:], True)):
            update = st.feed(piece, final)
            got_content += update.content
            for d in update.tool_calls:
                if d.name is not None:
                    names[d.index] = d.name
                args[d.index] = args.get(d.index, "") + d.arguments
        assert [ParsedCall(names[i], args[i]) for i in sorted(names)] == calls, cut
        assert got_content == (content or ""), cut


def test_auto_picks_mistral_from_the_template() -> None:
    assert resolve_tool_parser_name("auto", "{{ '[TOOL_CALLS]' }}") == "mistral"
    assert resolve_tool_parser_name("pythonic", None) == "pythonic"
