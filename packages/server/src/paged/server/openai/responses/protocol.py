"""Responses API request, output items, response object and stream events (pydantic).

Shapes follow the openai client's `openai.types.responses` and vLLM 0.33
(vllm/entrypoints/openai/responses/protocol.py:246-475 for the request,
:863-1031 for the response). `input` items are kept as dicts here and checked
item by item in `inputs.py`, so a bad item is a 400 naming `input[i].field`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from paged.server.openai.protocol import INT64_MAX, INT64_MIN, TopLevelRequest

ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def random_uuid() -> str:
    """vLLM's random_uuid: 32 hex digits."""
    return uuid.uuid4().hex


class ResponsesRequest(TopLevelRequest):
    """POST /v1/responses. Defaults as vLLM 0.33 (`store` true, `tool_choice` "auto")."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None  # refused (vLLM: "prompt template is not supported")
    reasoning: dict[str, Any] | None = None
    include_reasoning: bool = True
    include: list[str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = 0
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM extras
    request_id: str | None = None
    priority: int = Field(0, json_schema_extra={"minimum": INT64_MIN, "maximum": INT64_MAX})
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None


# -- output items (openai.types.responses) -----------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]
    status: ItemStatus


class FunctionToolCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus | None = None


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: ItemStatus | None = None


OutputItem = OutputMessage | FunctionToolCall | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    tool_output_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesResponse(BaseModel):
    """The response object (vLLM's ResponsesResponse.from_request fills it from the request)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    background: bool = False
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


# -- stream events (openai.types.responses.Response*Event) ------------------------------


class StreamEvent(BaseModel):
    """Every event carries its `type` and a `sequence_number` (0, 1, ... per stream)."""

    type: str
    sequence_number: int = -1  # set by the numbering as the event leaves


class ResponseLifecycleEvent(StreamEvent):
    """response.created / in_progress / completed / incomplete / failed."""

    response: ResponsesResponse


class OutputItemEvent(StreamEvent):
    """response.output_item.added / done."""

    output_index: int
    item: OutputItem


class ContentPartEvent(StreamEvent):
    """response.content_part.added / done."""

    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(StreamEvent):
    """response.output_text.delta / response.reasoning_text.delta."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(StreamEvent):
    """response.output_text.done / response.reasoning_text.done."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ArgumentsDeltaEvent(StreamEvent):
    """response.function_call_arguments.delta."""

    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(StreamEvent):
    """response.function_call_arguments.done (with the call's name, as vLLM sends it)."""

    item_id: str
    output_index: int
    arguments: str
    name: str


class ErrorEvent(StreamEvent):
    """`error`: a failure after the stream started (OpenAI's ResponseErrorEvent)."""

    code: str | None = None
    message: str
    param: str | None = None
