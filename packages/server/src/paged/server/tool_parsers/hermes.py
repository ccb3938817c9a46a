"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

vLLM's `hermes` parser. Text before, between and after the blocks is content (vLLM
keeps only the text before the first block); a block whose JSON is not a call stays in
the content as written. An unterminated last block (the output stopped inside it) is
parsed when the output ends, as vLLM's `<tool_call>(.*)` alternative does.
"""

from __future__ import annotations

import json

from paged.server.tool_parsers.base import Content, Segment, ToolParser, call_from_json, held_back
from paged.server.tool_parsers.partial_json import PartialCall, partial_call_in_object

START = "<tool_call>"
END = "</tool_call>"


def _block(raw: str, inner: str) -> Segment:
    try:
        obj = json.loads(inner)
    except ValueError:
        return Content(raw)
    call = call_from_json(obj, ("arguments", "parameters"))
    return call if call is not None else Content(raw)


class HermesToolParser(ToolParser):
    name = "hermes"

    def split(self, text: str, final: bool) -> list[Segment]:
        out: list[Segment] = []
        pos = 0
        while pos < len(text):
            start = text.find(START, pos)
            if start < 0:
                # Hold back a possible partial start tag ("<tool_c") until it resolves.
                end = len(text) if final else len(text) - held_back(text[pos:], START)
                if end > pos:
                    out.append(Content(text[pos:end]))
                break
            if start > pos:
                out.append(Content(text[pos:start]))
            body = start + len(START)
            stop = text.find(END, body)
            if stop < 0:
                if final:
                    out.append(_block(text[start:], text[body:]))
                break  # not final: the block is still being written
            out.append(_block(text[start : stop + len(END)], text[body:stop]))
            pos = stop + len(END)
        return out

    def partial_call(self, text: str) -> PartialCall | None:
        start = text.rfind(START)
        if start < 0 or text.find(END, start) >= 0:
            return None
        return partial_call_in_object(text, start + len(START), ("arguments", "parameters"))
