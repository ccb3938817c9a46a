"""Output items of one generation: whole (non-streaming) and as stream events.

Order and statuses as vLLM 0.33: a reasoning item, then the message, then one
`function_call` item per call (responses/utils.py:110-191); only the last
item can have been cut by `max_output_tokens` ("incomplete"), earlier ones
are "completed"; an empty message is left out.

`StreamItems` is vLLM's SimpleStreamingEventProcessor state machine
(streaming_events.py:818-1380): each piece of output goes to a state
(reasoning, content, one tool call); switching state closes the open item
(`*.done`, `content_part.done`, `output_item.done`) and opens the next
(`output_item.added`, plus `content_part.added` for text). Reasoning is
already wired (`reasoning(...)`, `build_output_items(reasoning=...)`): a
reasoning parser only has to feed its text there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from paged.server.openai.responses.protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionToolCall,
    ItemStatus,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
    random_uuid,
)
from paged.server.tool_parsers import ParsedCall, make_tool_call_id


def item_status(finish_reason: str | None) -> Literal["completed", "incomplete"]:
    """vLLM's response_item_status: cut by the token limit -> "incomplete"."""
    return "incomplete" if finish_reason == "length" else "completed"


def build_output_items(
    reasoning: str | None,
    content: str | None,
    calls: list[ParsedCall],
    finish_reason: str | None,
    logprobs: list[dict[str, Any]] | None = None,
) -> list[OutputItem]:
    """One generation's items (non-streaming); `logprobs` go with the message's text."""
    last = item_status(finish_reason)
    items: list[OutputItem] = []
    if reasoning:
        items.append(
            ReasoningItem(id=f"rs_{random_uuid()}", content=[ReasoningText(text=reasoning)])
        )
    if content:
        items.append(
            OutputMessage(
                id=f"msg_{random_uuid()}",
                content=[OutputText(text=content, logprobs=logprobs)],
                status="completed" if calls else last,
            )
        )
    for i, call in enumerate(calls):
        items.append(
            FunctionToolCall(
                id=f"fc_{random_uuid()}",
                call_id=make_tool_call_id(),
                name=call.name,
                arguments=call.arguments,
                status=last if i == len(calls) - 1 else "completed",
            )
        )
    return items


State = Literal["none", "reasoning", "content", "tool_call"]


@dataclass
class StreamItems:
    """Turns output pieces into Responses stream events; `items` collects the done items."""

    items: list[OutputItem] = field(default_factory=list)
    _state: State = "none"
    _output_index: int = 0
    _item_id: str = ""
    _text: str = ""
    _logprobs: list[dict[str, Any]] = field(default_factory=list)
    _call_index: int | None = None
    _call_id: str = ""
    _call_name: str = ""

    # -- the three kinds of pieces ---------------------------------------------------------

    def reasoning(self, delta: str) -> list[StreamEvent]:
        if not delta:
            return []
        events = self._switch("reasoning")
        self._text += delta
        events.append(self._text_delta("response.reasoning_text.delta", delta))
        return events

    def content(
        self, delta: str, logprobs: list[dict[str, Any]] | None = None
    ) -> list[StreamEvent]:
        """`logprobs`: the delta's tokens (OpenAI's output_text logprob entries)."""
        if not delta:
            return []
        events = self._switch("content")
        self._text += delta
        self._logprobs += logprobs or []
        event = self._text_delta("response.output_text.delta", delta)
        event.logprobs = [_delta_logprob(lp) for lp in logprobs or []]
        events.append(event)
        return events

    def tool_call(
        self, index: int, arguments: str, call_id: str | None = None, name: str | None = None
    ) -> list[StreamEvent]:
        """A call's first piece brings its name (and id); later pieces only arguments."""
        events: list[StreamEvent] = []
        if self._state != "tool_call" or self._call_index != index:
            events += self.close("completed")
            events += self._open_call(index, call_id or make_tool_call_id(), name or "")
        if arguments:
            self._text += arguments
            events.append(
                ArgumentsDeltaEvent(
                    type="response.function_call_arguments.delta",
                    item_id=self._item_id,
                    output_index=self._output_index,
                    delta=arguments,
                )
            )
        return events

    def close(self, status: ItemStatus = "completed") -> list[StreamEvent]:
        """Close the open item (at a switch, or at the end with the finish's status)."""
        state, self._state = self._state, "none"
        if state == "none":
            return []
        if state == "tool_call":
            events = self._close_call(status)
        else:
            events = self._close_text(state, status)
        done = events[-1]
        assert isinstance(done, OutputItemEvent)
        self.items.append(done.item)
        self._output_index += 1
        return events

    # -- internals ----------------------------------------------------------------------

    def _switch(self, state: State) -> list[StreamEvent]:
        if self._state == state:
            return []
        events = self.close("completed")
        self._state = state
        self._text = ""
        self._logprobs = []
        prefix = "rs" if state == "reasoning" else "msg"
        self._item_id = f"{prefix}_{random_uuid()}"
        item: OutputItem
        part: OutputText | ReasoningText
        if state == "reasoning":
            item = ReasoningItem(id=self._item_id, status="in_progress")
            part = ReasoningText(text="")
        else:
            item = OutputMessage(id=self._item_id, content=[], status="in_progress")
            part = OutputText(text="", logprobs=[])
        events.append(self._item_event("response.output_item.added", item))
        events.append(self._part_event("response.content_part.added", part))
        return events

    def _open_call(self, index: int, call_id: str, name: str) -> list[StreamEvent]:
        self._state = "tool_call"
        self._text = ""
        self._call_index, self._call_id, self._call_name = index, call_id, name
        self._item_id = f"fc_{random_uuid()}"
        item = FunctionToolCall(
            id=self._item_id, call_id=call_id, name=name, arguments="", status="in_progress"
        )
        return [self._item_event("response.output_item.added", item)]

    def _close_call(self, status: ItemStatus) -> list[StreamEvent]:
        item = FunctionToolCall(
            id=self._item_id,
            call_id=self._call_id,
            name=self._call_name,
            arguments=self._text,
            status=status,
        )
        return [
            ArgumentsDoneEvent(
                type="response.function_call_arguments.done",
                item_id=self._item_id,
                output_index=self._output_index,
                arguments=self._text,
                name=self._call_name,
            ),
            self._item_event("response.output_item.done", item),
        ]

    def _close_text(self, state: State, status: ItemStatus) -> list[StreamEvent]:
        item: OutputItem
        part: OutputText | ReasoningText
        if state == "reasoning":
            part = ReasoningText(text=self._text)
            item = ReasoningItem(id=self._item_id, content=[part], status=status)
            kind = "response.reasoning_text.done"
        else:
            part = OutputText(text=self._text, logprobs=self._logprobs or None)
            item = OutputMessage(id=self._item_id, content=[part], status=status)
            kind = "response.output_text.done"
        done = TextDoneEvent(
            type=kind,
            item_id=self._item_id,
            output_index=self._output_index,
            content_index=0,
            text=self._text,
        )
        return [
            done,
            self._part_event("response.content_part.done", part),
            self._item_event("response.output_item.done", item),
        ]

    def _text_delta(self, kind: str, delta: str) -> TextDeltaEvent:
        return TextDeltaEvent(
            type=kind,
            item_id=self._item_id,
            output_index=self._output_index,
            content_index=0,
            delta=delta,
        )

    def _item_event(self, kind: str, item: OutputItem) -> OutputItemEvent:
        return OutputItemEvent(type=kind, output_index=self._output_index, item=item)

    def _part_event(self, kind: str, part: OutputText | ReasoningText) -> ContentPartEvent:
        return ContentPartEvent(
            type=kind,
            item_id=self._item_id,
            output_index=self._output_index,
            content_index=0,
            part=part,
        )


def _delta_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """A delta event's logprob: token and logprob, no bytes (vLLM's _to_stream_logprobs)."""
    tops = [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]]
    return {"token": entry["token"], "logprob": entry["logprob"], "top_logprobs": tops}
