"""paged's `generic` tool-call format, for models whose chat template ignores `tools`.

The output is one JSON object (the structured-output backend enforces it):

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    {"response": "Hello! How can I help?"}

the shape of llama.cpp's generic format (common/chat.cpp,
`common_chat_params_init_generic`), with the calls always in an array so
that one shape covers one or several calls. The `response` string is the
message's `content`, decoded; it streams as it is written (a partial escape
waits), so streamed content adds up to the non-streaming one. Until the key
shows which of the two it is, nothing is sent.

Without the grammar (or cut by `max_tokens`) the text may be anything: what
does not read as the format is content, as the model wrote it.
"""

from __future__ import annotations

import json
import re

from paged.server.tool_parsers.base import Content, ParsedCall, Segment, ToolParser
from paged.server.tool_parsers.partial_json import PartialCall, read_string
from paged.server.tool_parsers.required import CallArrayScanner

CALLS_KEY = "tool_calls"
RESPONSE_KEY = "response"
ARGUMENTS_KEY = "arguments"

_CALLS_HEAD = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*(?=\[)')
_RESPONSE_HEAD = re.compile(r'\s*\{\s*"response"\s*:\s*"')
# The two heads with whitespace removed: a text whose compacted form is a prefix of
# one of them may still become that head.
_HEADS = ('{"tool_calls":[', '{"response":"')


def _undecided(text: str) -> bool:
    compact = "".join(text.split())
    return any(head.startswith(compact) for head in _HEADS)


def _decode_partial_string(text: str, pos: int) -> tuple[str, bool]:
    """From just inside a JSON string: (its decoded characters so far, closed)."""
    serialised, _, closed = read_string(text, pos)
    body = serialised[:-1] if closed else serialised
    return json.loads(f'"{body}"'), closed


class GenericToolParser(ToolParser):
    """Reads the generic format (see the module docstring); monotone for streaming."""

    name = "generic"

    def __init__(self) -> None:
        self._calls = CallArrayScanner((ARGUMENTS_KEY,))

    def split(self, text: str, final: bool) -> list[Segment]:
        head = _CALLS_HEAD.match(text)
        if head is not None:
            return self._split_calls(text, head.end(), final)
        head = _RESPONSE_HEAD.match(text)
        if head is not None:
            return self._split_response(text, head.end(), final)
        if not final and _undecided(text):
            return []
        return [Content(text)] if text else []

    def partial_call(self, text: str) -> PartialCall | None:
        head = _CALLS_HEAD.match(text)
        if head is None:
            return None
        return self._calls.partial_call(text[head.end() :])

    def _split_calls(self, text: str, start: int, final: bool) -> list[Segment]:
        segments = self._calls.split(text[start:], final)
        if segments and isinstance(segments[0], Content):
            return [Content(text)]  # not an array of calls after all: keep it as written
        out: list[Segment] = [s for s in segments if isinstance(s, ParsedCall)]
        tail = "".join(s.text for s in segments if isinstance(s, Content))
        # After the array only the object's closing brace belongs to the format.
        rest = tail.strip()
        if rest.startswith("}"):
            rest = rest[1:].strip()
        if rest:
            out.append(Content(rest))
        return out

    def _split_response(self, text: str, start: int, final: bool) -> list[Segment]:
        try:
            decoded, closed = _decode_partial_string(text, start)
        except ValueError:
            return [Content(text)] if final else []
        if final and not closed:
            # Cut short (max_tokens): the answer so far, as it was streamed.
            return [Content(decoded)] if decoded else []
        if closed and final:
            try:
                obj = json.loads(text)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get(RESPONSE_KEY), str):
                return [Content(obj[RESPONSE_KEY])] if obj[RESPONSE_KEY] else []
        return [Content(decoded)] if decoded else []
