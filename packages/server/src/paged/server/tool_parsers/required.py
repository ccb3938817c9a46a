"""`tool_choice: "required"` output: a JSON array of `{"name": ..., "parameters": {...}}`.

The shape of vLLM's `get_json_schema_from_tool` for "required" (the structured-output
backend constrains the output to it); parsed back into calls without a text parser.
A malformed array (nothing enforced it) is content, as everywhere else.
"""

from __future__ import annotations

import json

from paged.server.tool_parsers.base import Content, Segment, ToolParser, call_from_json
from paged.server.tool_parsers.partial_json import PartialCall, partial_call_in_object

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


class CallArrayScanner(ToolParser):
    """A JSON array of `{"name": ..., <args key>: {...}}` objects (the text starts with it).

    Shared by `"required"` (args key `parameters`) and the generic format (`arguments`).
    """

    name = "call_array"

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self._args_keys = args_keys

    def split(self, text: str, final: bool) -> list[Segment]:
        return self._scan(text, final)[0]

    def partial_call(self, text: str) -> PartialCall | None:
        open_at = self._scan(text, final=False)[1]
        if open_at is None:
            return None
        return partial_call_in_object(text, open_at, self._args_keys)

    def _scan(self, text: str, final: bool) -> tuple[list[Segment], int | None]:
        """The segments, and where an object still being written starts (not final)."""
        pos = _skip(text, 0, _WS)
        if pos == len(text):
            return ([Content(text)] if final and text else []), None
        if text[pos] != "[":
            return [Content(text)], None
        out: list[Segment] = []
        pos = _skip(text, pos + 1, _WS)
        while pos < len(text):
            if text[pos] == "]":
                if not out:
                    return [Content(text)], None  # "[]": no call, keep the text
                rest = text[pos + 1 :]
                if rest and (final or rest.strip()):
                    out.append(Content(rest))  # text after the array
                return out, None
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except ValueError:
                if final:
                    out.append(Content(text if not out else text[pos:]))
                    return out, None
                return out, pos
            call = call_from_json(obj, self._args_keys)
            if call is None:
                return [*out, Content(text if not out else text[pos:])], None
            out.append(call)
            pos = _skip(text, end, _WS + ",")
        if final and not out:
            out.append(Content(text))  # "[" and nothing more
        return out, None


class RequiredArrayParser(CallArrayScanner):
    name = "required"

    def __init__(self) -> None:
        super().__init__(("parameters",))
