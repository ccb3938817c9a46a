"""Tool calls as OpenAI stream deltas, from a parser's monotone segments.

Each `feed` re-splits the whole output so far (outputs are short next to the
model's time per token) and sends what is new: content text, and tool calls
as OpenAI's stream does: a call's first delta carries its `id`/`type`/`name`,
the following ones pieces of its `function.arguments`. While a call is being
written (the parser's `partial_call`), its name is sent as soon as it is
complete and its arguments token by token, as the stable prefix of their
final serialisation (`partial_json`), so the pieces add up to exactly the
non-streaming `arguments`. A call the parser cannot read before it is
complete is sent whole when it is. (A call whose header was sent and that
then turns out malformed cannot be taken back; its text is not repeated as
content.)

Whitespace-only content is held back until non-blank content follows (or the
output ends without calls), so the streamed content adds up to exactly the
non-streaming `content` (null when only whitespace surrounds the calls).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol

from paged.server.tool_parsers.base import Content, ParsedCall, ToolParser
from paged.server.tool_parsers.partial_json import stable_json_prefix


def make_tool_call_id() -> str:
    """vLLM's id for a tool call: `chatcmpl-tool-<32 hex digits>`."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One `delta.tool_calls[]` entry; `id` and `name` only in a call's first delta."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class StreamUpdate:
    """What one feed adds: content text (may be empty) and tool-call deltas, in order."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolStreamer(Protocol):
    """Turns text deltas of one choice into content and tool-call deltas."""

    @property
    def tools_called(self) -> bool: ...

    def feed(self, delta_text: str, final: bool) -> StreamUpdate: ...


def call_deltas(index: int, call: ParsedCall) -> list[ToolCallDelta]:
    return [
        ToolCallDelta(index=index, arguments="", id=make_tool_call_id(), name=call.name),
        ToolCallDelta(index=index, arguments=call.arguments),
    ]


class ParserStreamer:
    """A `ToolStreamer` over a `ToolParser` (auto tool choice and "required")."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._content_seen = 0  # characters of content already taken from the segments
        self._calls_sent = 0  # complete calls sent in full
        # The call being streamed before it is complete: its index and the
        # arguments text sent so far (None: no open call).
        self._open_index: int | None = None
        self._open_sent = ""
        self._pending_ws = ""  # whitespace-only content not yet sent
        self._sent_text = False  # non-blank content was sent

    @property
    def tools_called(self) -> bool:
        return self._calls_sent > 0 or self._open_index is not None

    def feed(self, delta_text: str, final: bool) -> StreamUpdate:
        self._text += delta_text
        update = StreamUpdate()
        new_content: list[str] = []
        pos = 0
        calls = 0
        for seg in self._parser.split(self._text, final):
            if isinstance(seg, Content):
                end = pos + len(seg.text)
                if end > self._content_seen:
                    new_content.append(seg.text[max(0, self._content_seen - pos) :])
                    self._content_seen = end
                pos = end
                continue
            if calls >= self._calls_sent:
                update.tool_calls.extend(self._complete(calls, seg))
            calls += 1
        self._calls_sent = max(self._calls_sent, calls)
        update.content = self._content("".join(new_content), final)
        if not final:
            update.tool_calls.extend(self._stream_open_call(calls))
        return update

    def _complete(self, index: int, call: ParsedCall) -> list[ToolCallDelta]:
        if self._open_index != index:
            return call_deltas(index, call)
        # Streamed so far: send the rest of its arguments.
        sent, self._open_index, self._open_sent = self._open_sent, None, ""
        if not call.arguments.startswith(sent):
            return []  # duplicate keys made the prefix wrong (see partial_json)
        rest = call.arguments[len(sent) :]
        return [ToolCallDelta(index=index, arguments=rest)] if rest else []

    def _stream_open_call(self, index: int) -> list[ToolCallDelta]:
        partial = self._parser.partial_call(self._text)
        if partial is None:
            return []
        out: list[ToolCallDelta] = []
        if self._open_index != index:
            self._open_index, self._open_sent = index, ""
            out.append(
                ToolCallDelta(index=index, arguments="", id=make_tool_call_id(), name=partial.name)
            )
        stable = stable_json_prefix(partial.raw_arguments)
        if len(stable) > len(self._open_sent) and stable.startswith(self._open_sent):
            out.append(ToolCallDelta(index=index, arguments=stable[len(self._open_sent) :]))
            self._open_sent = stable
        return out

    def _content(self, text: str, final: bool) -> str:
        if text.strip():
            out, self._pending_ws = self._pending_ws + text, ""
            self._sent_text = True
            return out
        self._pending_ws += text
        if final and (self._sent_text or not self.tools_called):
            out, self._pending_ws = self._pending_ws, ""
            return out
        return ""


class NamedToolStreamer:
    """A `ToolStreamer` for a named `tool_choice`: all output is that call's arguments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    @property
    def tools_called(self) -> bool:
        return self._started

    def feed(self, delta_text: str, final: bool) -> StreamUpdate:
        update = StreamUpdate()
        if not self._started:
            self._started = True
            update.tool_calls.append(
                ToolCallDelta(index=0, arguments="", id=make_tool_call_id(), name=self._name)
            )
        if delta_text:
            update.tool_calls.append(ToolCallDelta(index=0, arguments=delta_text))
        return update
