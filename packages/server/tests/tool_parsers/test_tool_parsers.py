"""Tool-call parsers: whole outputs, malformed calls, and streams split everywhere."""

from __future__ import annotations

import json

import pytest

from paged.server.tool_parsers import (
    ExtractedToolCalls,
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolStreamer,
    ParsedCall,
    ParserStreamer,
    RequiredArrayParser,
    ToolParser,
    resolve_tool_parser_name,
)


def call(name: str, **args: object) -> ParsedCall:
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


HERMES = HermesToolParser()
LLAMA = Llama3JsonToolParser()
REQUIRED = RequiredArrayParser()

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
T = '{"name": "get_time", "arguments": {"tz": "日本"}}'

# (parser, output, expected calls, expected content)
CASES: list[tuple[ToolParser, str, list[ParsedCall], str | None]] = [
    (
        HERMES,
        f"<tool_call>\n{W}\n</tool_call>",
        [call("get_weather", city="Paris", unit="c")],
        None,
    ),
    (
        HERMES,
        f"Let me check.\n<tool_call>{W}</tool_call>\n<tool_call>{T}</tool_call>",
        [call("get_weather", city="Paris", unit="c"), call("get_time", tz="日本")],
        "Let me check.\n\n",
    ),
    (
        HERMES,
        f"A <tool_call>{W}</tool_call> B",
        [call("get_weather", city="Paris", unit="c")],
        "A  B",
    ),
    # malformed JSON inside the tags: content, as written
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": {</tool_call>',
        [],
        '<tool_call>{"name": "f", "arguments": {</tool_call>',
    ),
    # valid JSON that is not a call (no name) next to a good one
    (
        HERMES,
        f'<tool_call>{{"x": 1}}</tool_call><tool_call>{T}</tool_call>',
        [call("get_time", tz="日本")],
        '<tool_call>{"x": 1}</tool_call>',
    ),
    # the output stopped inside a call: parsed when complete, content otherwise
    (HERMES, f"<tool_call>{W}", [call("get_weather", city="Paris", unit="c")], None),
    (HERMES, '<tool_call>{"name": "get_wea', [], '<tool_call>{"name": "get_wea'),
    (HERMES, "no tools here <tool", [], "no tools here <tool"),
    (HERMES, "", [], ""),
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        [call("f", a=1)],
        None,
    ),
    (
        HERMES,
        '<tool_call>{"name": "f", "arguments": "a"}</tool_call>',
        [],
        '<tool_call>{"name": "f", "arguments": "a"}</tool_call>',
    ),
    (HERMES, '<tool_call>{"name": "noargs"}</tool_call>', [ParsedCall("noargs", "{}")], None),
    (
        LLAMA,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        [call("get_weather", city="Paris")],
        None,
    ),
    (
        LLAMA,
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, 2]}}',
        [ParsedCall("a", "{}"), call("b", x=[1, 2])],
        None,
    ),
    (LLAMA, ' {"name": "a", "parameters": {}} done', [ParsedCall("a", "{}")], "done"),
    (LLAMA, "The weather is sunny.", [], "The weather is sunny."),
    (LLAMA, '{"name": "a", "parameters": {"x": }', [], '{"name": "a", "parameters": {"x": }'),
    (LLAMA, '{"city": "Paris"}', [], '{"city": "Paris"}'),
    (LLAMA, "<|python_tag|>", [], "<|python_tag|>"),
    (
        REQUIRED,
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {}}]',
        [call("get_weather", city="Paris"), ParsedCall("get_time", "{}")],
        None,
    ),
    (REQUIRED, "[]", [], "[]"),
    (
        REQUIRED,
        '[{"name": "a", "parameters": {"x": 1}',
        [],
        '[{"name": "a", "parameters": {"x": 1}',
    ),
    (REQUIRED, "plain text", [], "plain text"),
]


@pytest.mark.parametrize(("parser", "text", "calls", "content"), CASES)
def test_extract(
    parser: ToolParser, text: str, calls: list[ParsedCall], content: str | None
) -> None:
    assert parser.extract(text) == ExtractedToolCalls(calls, content)


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ParsedCall], list[str]]:
    """Feed `pieces`, then rebuild content and calls from the deltas as a client does."""
    st = ParserStreamer(parser)
    content = ""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    ids: list[str] = []
    for i, piece in enumerate(pieces):
        update = st.feed(piece, final=i == len(pieces) - 1)
        content += update.content
        for d in update.tool_calls:
            if d.id is not None:
                assert d.index not in names, "id and name come once per call"
                assert d.name is not None
                names[d.index] = d.name
                ids.append(d.id)
            else:
                assert d.name is None and d.index in names
            args[d.index] = args.get(d.index, "") + d.arguments
    assert sorted(names) == list(range(len(names)))
    assert st.tools_called == bool(names)
    return content, [ParsedCall(names[i], args[i]) for i in sorted(names)], ids


@pytest.mark.parametrize(("parser", "text", "calls", "content"), CASES)
def test_stream_split_anywhere_matches_extract(
    parser: ToolParser, text: str, calls: list[ParsedCall], content: str | None
) -> None:
    pieces_list = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    pieces_list.append([*text, ""])  # one character at a time, then the end
    for a in range(0, len(text) + 1, 7):  # three pieces
        for b in range(a, len(text) + 1, 5):
            pieces_list.append([text[:a], text[a:b], text[b:]])
    for pieces in pieces_list:
        got_content, got_calls, ids = _stream(parser, pieces)
        if len(got_calls) == len(calls) + 1:
            # A call streamed while it was written turned out malformed: what was
            # sent cannot be taken back (vLLM alike); the text is still content.
            assert got_calls[: len(calls)] == calls, pieces
        else:
            assert got_calls == calls, pieces
        assert got_content == (content or ""), pieces
        assert all(i.startswith("chatcmpl-tool-") and len(i) == 14 + 32 for i in ids)
        assert len(set(ids)) == len(ids)


def test_stream_sends_text_before_a_call_before_the_call_is_complete() -> None:
    st = ParserStreamer(HERMES)
    first = st.feed('Checking now. <tool_call>{"name": "get_weather", ', final=False)
    assert first.content == "Checking now. " and first.tool_calls == []
    second = st.feed('"arguments": {}}</tool_call>', final=False)
    assert [d.name for d in second.tool_calls] == ["get_weather", None]
    assert second.tool_calls[1].arguments == "{}"
    assert st.feed("\n", final=True).content == "\n"  # kept: the content is not blank


def test_stream_holds_a_partial_start_tag() -> None:
    st = ParserStreamer(HERMES)
    assert st.feed("a <tool_", final=False).content == "a "
    assert st.feed("x>", final=False).content == "<tool_x>"


def test_stream_drops_blank_content_around_calls() -> None:
    st = ParserStreamer(HERMES)
    assert st.feed("\n", final=False).content == ""  # held: it may stay blank
    update = st.feed('<tool_call>{"name": "f"}</tool_call>\n', final=True)
    assert update.content == "" and [d.name for d in update.tool_calls] == ["f", None]


def test_named_streamer_sends_the_name_then_the_raw_arguments() -> None:
    st = NamedToolStreamer("get_weather")
    u1 = st.feed('{"city', final=False)
    assert [(d.index, d.name, d.arguments) for d in u1.tool_calls] == [
        (0, "get_weather", ""),
        (0, None, '{"city'),
    ]
    assert u1.tool_calls[0].id is not None and u1.tool_calls[1].id is None
    u2 = st.feed('": "Paris"}', final=True)
    assert [(d.id, d.name, d.arguments) for d in u2.tool_calls] == [(None, None, '": "Paris"}')]
    assert u2.content == "" and st.tools_called


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ '<tool_call>' }}{{ tools | tojson }}", "hermes"),
        ("<|start_header_id|>ipython<|end_header_id|><|python_tag|>", "llama3_json"),
    ],
)
def test_auto_picks_the_parser_from_the_template(template: str, expected: str) -> None:
    assert resolve_tool_parser_name("auto", template) == expected


def test_auto_without_a_known_format_and_unknown_names_fail() -> None:
    with pytest.raises(ValueError, match="name the parser"):
        resolve_tool_parser_name("auto", "{{ messages }}")
    with pytest.raises(ValueError, match="invalid tool call parser: granite"):
        resolve_tool_parser_name("granite", None)
    assert resolve_tool_parser_name("hermes", None) == "hermes"
