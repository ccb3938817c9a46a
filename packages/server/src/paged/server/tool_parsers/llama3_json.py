"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, several joined by `;`.

vLLM's `llama3_json` parser: an output is tool calls only when it starts (after
whitespace and an optional `<|python_tag|>`) with a JSON object naming a function;
otherwise all of it is content. `"arguments"` is accepted in place of
`"parameters"`, as vLLM does. Text after the last call is content.
"""

from __future__ import annotations

import json

from paged.server.tool_parsers.base import Content, Segment, ToolParser, call_from_json
from paged.server.tool_parsers.partial_json import PartialCall, partial_call_in_object

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()
_SEPARATORS = " \t\r\n;"


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def split(self, text: str, final: bool) -> list[Segment]:
        return self._scan(text, final)[0]

    def partial_call(self, text: str) -> PartialCall | None:
        open_at = self._scan(text, final=False)[1]
        if open_at is None:
            return None
        return partial_call_in_object(text, open_at, ("parameters", "arguments"))

    def _scan(self, text: str, final: bool) -> tuple[list[Segment], int | None]:
        """The segments, and where an object still being written starts (not final)."""
        pos = _skip(text, 0, " \t\r\n")
        rest = text[pos:]
        if not final and (not rest or PYTHON_TAG.startswith(rest)):
            return [], None  # too early to tell calls from text
        if rest.startswith(PYTHON_TAG):
            pos = _skip(text, pos + len(PYTHON_TAG), " \t\r\n")
        if (pos < len(text) and text[pos] != "{") or (pos == len(text) and final):
            return ([Content(text)] if text else []), None
        out: list[Segment] = []
        while pos < len(text):
            if text[pos] != "{":
                out.append(Content(text[pos:]))  # trailing text after the calls
                break
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except ValueError:
                # Incomplete (wait) or invalid (content once the output ends). An
                # object only decodes once its closing brace is there, so a call
                # decoded from a prefix is the same call in every longer text.
                if final:
                    out.append(Content(text if not out else text[pos:]))
                    break
                return out, pos
            call = call_from_json(obj, ("parameters", "arguments"))
            if call is None:
                out.append(Content(text if not out else text[pos:]))
                break
            out.append(call)
            pos = _skip(text, end, _SEPARATORS)
        return out, None
