"""A call still being written: its name, and the stable prefix of its arguments.

Streaming sends a call's `function.arguments` in pieces while the model writes
them, and the pieces must add up to exactly the non-streaming `arguments`,
which is `json.dumps(args, ensure_ascii=False)` (vLLM's form). So the raw
text is not forwarded as is: `stable_json_prefix` re-serialises the part of
the raw JSON whose serialisation no later text can change:

    raw   '{ "city" :"Par'        ->  '{"city": "Par'
    raw   '{"n": 1.50, "u": "\\u00e9'  ->  '{"n": 1.5, "u": "é'

Structure and strings are written as soon as they are read (partial escapes
wait); a number or literal waits for the delimiter after it, since `1` may
become `10`. Duplicate keys (json.loads keeps the last value at the first
key's place) are the one case where the prefix can disagree with the final
text; the streamer then sends nothing more for that call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"
_LITERAL_END = _WS + ",]}"


@dataclass(frozen=True, slots=True)
class PartialCall:
    """The open call: its name, and its arguments' raw JSON text from the `{` on."""

    name: str
    raw_arguments: str


def _dumps_char(ch: str) -> str:
    return json.dumps(ch, ensure_ascii=False)[1:-1]


def read_string(raw: str, pos: int) -> tuple[str, int, bool]:
    """From just inside a string: (serialised chars, new pos, string closed)."""
    out: list[str] = []
    n = len(raw)
    while pos < n:
        ch = raw[pos]
        if ch == '"':
            out.append('"')
            return "".join(out), pos + 1, True
        if ch != "\\":
            out.append(_dumps_char(ch))
            pos += 1
            continue
        if pos + 1 >= n:
            break  # a lone backslash: wait for what it escapes
        esc = raw[pos + 1]
        if esc != "u":
            try:
                out.append(_dumps_char(json.loads(f'"\\{esc}"')))
            except ValueError:
                break  # invalid escape: the call will not parse; stop here
            pos += 2
            continue
        code = raw[pos + 2 : pos + 6]
        if len(code) < 4:
            break
        try:
            value = int(code, 16)
        except ValueError:
            break
        if 0xD800 <= value < 0xDC00:  # a high surrogate: its pair must follow
            tail = raw[pos + 6 : pos + 12]
            if len(tail) < 6:
                break
            try:
                decoded = json.loads(f'"\\u{code}{tail}"')
            except ValueError:
                break
            out.append(_dumps_char(decoded))
            pos += 12
            continue
        out.append(_dumps_char(chr(value)))
        pos += 6
    return "".join(out), pos, False


def stable_json_prefix(raw: str) -> str:
    """The prefix of `json.dumps(json.loads(full), ensure_ascii=False)` that `raw` fixes.

    `raw` starts at a JSON value's first character (whitespace before it is
    skipped); reading stops at the end of that value or where `raw` ends.
    """
    out: list[str] = []
    pos, n, depth = 0, len(raw), 0
    while pos < n:
        ch = raw[pos]
        if ch in _WS:
            pos += 1
        elif ch in "{[":
            out.append(ch)
            depth += 1
            pos += 1
        elif ch in "}]":
            out.append(ch)
            depth -= 1
            pos += 1
            if depth <= 0:
                break
        elif ch == ",":
            out.append(", ")
            pos += 1
        elif ch == ":":
            out.append(": ")
            pos += 1
        elif ch == '"':
            text, pos, closed = read_string(raw, pos + 1)
            out.append('"' + text)
            if not closed:
                break
            if depth == 0:
                break
        else:
            end = pos
            while end < n and raw[end] not in _LITERAL_END:
                end += 1
            if end == n:
                break  # the literal may go on
            try:
                out.append(json.dumps(json.loads(raw[pos:end])))
            except ValueError:
                break
            pos = end
            if depth == 0:
                break
    return "".join(out)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def partial_call_in_object(text: str, start: int, args_keys: tuple[str, ...]) -> PartialCall | None:
    """The open call written as `{"name": "...", <args key>: {...` from `text[start]` on.

    None until the name is complete and the arguments object has begun, or
    if the call is written in another order or shape (it is then sent whole
    once complete).
    """
    pos = _skip_ws(text, start)
    if pos >= len(text) or text[pos] != "{":
        return None
    decoder = json.JSONDecoder()
    name: str | None = None
    pos += 1
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text) or text[pos] != '"':
            return None
        try:
            key, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        pos = _skip_ws(text, pos)
        if pos >= len(text) or text[pos] != ":":
            return None
        pos = _skip_ws(text, pos + 1)
        if key in args_keys:
            if name is None or pos >= len(text) or text[pos] != "{":
                return None
            return PartialCall(name, text[pos:])
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        if key == "name":
            if not isinstance(value, str) or not value:
                return None
            name = value
        pos = _skip_ws(text, pos)
        if pos >= len(text) or text[pos] != ",":
            return None
        pos += 1
