"""Mistral tool calls: content, then `[TOOL_CALLS]` and the calls (vLLM's `mistral`).

Two layouts, as vLLM reads them:

    [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]     tokenizers before v11
    [TOOL_CALLS]f{...}[TOOL_CALLS]g[ARGS]{...}                v11 and later

Text before the first `[TOOL_CALLS]` is content; after it everything must be
calls, or the whole output stays content (a malformed call is never an error).
Calls are sent once complete (no `partial_call`).
"""

from __future__ import annotations

import json

from paged.server.tool_parsers.base import Content, Segment, ToolParser, call_from_json, held_back

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_DECODER = json.JSONDecoder()


def _array_calls(body: str) -> list[Segment] | None:
    try:
        obj, end = _DECODER.raw_decode(body)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls: list[Segment] = []
    for item in items:
        call = call_from_json(item, ("arguments", "parameters"))
        if call is None:
            return None
        calls.append(call)
    if body[end:].strip():
        return None
    return calls


def _named_calls(parts: list[str]) -> list[Segment] | None:
    calls: list[Segment] = []
    for part in parts:
        name, sep, args = part.partition(ARGS)
        if not sep:
            brace = part.find("{")
            if brace < 0:
                return None
            name, args = part[:brace], part[brace:]
        call = call_from_json({"name": name.strip(), "arguments": _loads(args)}, ("arguments",))
        if call is None:
            return None
        calls.append(call)
    return calls


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


class MistralToolParser(ToolParser):
    name = "mistral"

    def split(self, text: str, final: bool) -> list[Segment]:
        start = text.find(BOT)
        if start < 0:
            end = len(text) if final else len(text) - held_back(text, BOT)
            return [Content(text[:end])] if end > 0 else []
        head: list[Segment] = [Content(text[:start])] if start > 0 else []
        if not final:
            return head  # the calls are complete only when the output ends
        body = text[start + len(BOT) :]
        calls = (
            _array_calls(body)
            if body.lstrip().startswith(("[", "{"))
            else _named_calls(body.split(BOT))
        )
        if not calls:
            return [Content(text)]
        return head + calls
