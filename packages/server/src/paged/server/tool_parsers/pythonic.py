"""Pythonic tool calls: `[get_weather(city="Paris"), get_time()]` (vLLM's `pythonic`).

The whole output (after optional Llama 4 `<|python_start|>`/`<|python_end|>`
tags) is a Python list of calls whose keyword arguments are literals; it is
read with `ast`, never evaluated. Anything else is content, as vLLM does. A
call is sent once the list is complete; until the output either ends or
cannot be a call list, nothing is sent as content either (it might be one).
"""

from __future__ import annotations

import ast
import json

from paged.server.tool_parsers.base import Content, ParsedCall, Segment, ToolParser

START, END = "<|python_start|>", "<|python_end|>"


def _literal(node: ast.expr) -> object:
    return ast.literal_eval(node)


def _parse(text: str) -> list[ParsedCall] | None:
    body = text.strip()
    if body.startswith(START):
        body = body[len(START) :]
        body = body[: -len(END)] if body.endswith(END) else body
        body = body.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls: list[ParsedCall] = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args: dict[str, object] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None  # **kwargs
            try:
                args[kw.arg] = _literal(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
        try:
            arguments = json.dumps(args, ensure_ascii=False)
        except (TypeError, ValueError):  # tuples are fine; sets, bytes and complex are not
            return None
        calls.append(ParsedCall(node.func.id, arguments))
    return calls


def _may_be_calls(text: str) -> bool:
    body = text.lstrip()
    return not body or body.startswith("[") or START.startswith(body[: len(START)])


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def split(self, text: str, final: bool) -> list[Segment]:
        if not final:
            return [] if _may_be_calls(text) else [Content(text)]
        calls = _parse(text)
        if calls is None:
            return [Content(text)] if text else []
        return list(calls)
