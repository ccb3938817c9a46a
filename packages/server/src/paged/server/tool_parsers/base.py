"""The tool-call parser contract: model text -> ordered content and tool-call segments.

A parser does not stream by itself. It answers one question, `split(text, final)`:
which segments does this text (the model's output so far) determine? (And,
optionally, `partial_call`: which call is being written after them?) With
`final=False` it returns only what no later text can change, so the segments of a
prefix are always a prefix of the segments of any longer text (the last `Content`
may grow). `ToolCallStreamer` turns that into deltas, and the non-streaming result
is `split(text, final=True)`: both paths share one parse, so a stream always adds up
to the non-streaming answer, wherever the token boundaries fall.

Malformed calls (invalid JSON, a missing name) are content, never an error.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from paged.server.tool_parsers.partial_json import PartialCall


@dataclass(frozen=True, slots=True)
class Content:
    """Text outside any tool call (or a malformed call, kept as the model wrote it)."""

    text: str


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


Segment = Content | ParsedCall


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """A whole output, parsed: the calls and the text outside them.

    `content` is None when calls were found and the rest is only whitespace
    (OpenAI's `"content": null`); without calls it is the text unchanged.
    """

    calls: list[ParsedCall]
    content: str | None

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


def assemble(segments: list[Segment]) -> ExtractedToolCalls:
    calls = [s for s in segments if isinstance(s, ParsedCall)]
    text = "".join(s.text for s in segments if isinstance(s, Content))
    if calls and not text.strip():
        return ExtractedToolCalls(calls, None)
    return ExtractedToolCalls(calls, text)


def call_from_json(obj: Any, args_keys: tuple[str, ...]) -> ParsedCall | None:
    """`{"name": str, <args key>: object}` -> a call; anything else -> None.

    A missing arguments object means no arguments (`{}`), as vLLM writes it;
    arguments given as JSON text of an object are read as that object.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        # Some models write the arguments as JSON text inside the JSON.
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser(ABC):
    """Splits model output into content and tool calls (see the module docstring)."""

    name: str = ""

    @abstractmethod
    def split(self, text: str, final: bool) -> list[Segment]:
        """The segments `text` determines; with `final`, all of it (the output ended)."""

    def partial_call(self, text: str) -> PartialCall | None:
        """The call being written after `split(text, final=False)`'s segments, if readable.

        Lets the streamer send the call's name, then its arguments piece by
        piece, before the call is complete. None (the default): the call is
        sent whole once complete.
        """
        return None

    def extract(self, text: str) -> ExtractedToolCalls:
        """The non-streaming result for a whole output."""
        return assemble(self.split(text, final=True))
