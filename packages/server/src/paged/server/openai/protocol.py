"""OpenAI-compatible request and response models (pydantic, served by FastAPI).

Known fields are typed strictly (no coercion: a wrong type is a 400), but
unknown fields are ignored with a logged warning, as vLLM does: clients send
other servers' extras (llama.cpp's `cache_prompt`, newer OpenAI fields) and
must not fail on them. vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, ...) are
accepted too; the `openai` client sends them through `extra_body`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidatorFunctionWrapHandler,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

logger = logging.getLogger(__name__)

# Integers travel to the engine core as msgspec ints (int64/uint64) and into
# torch; anything beyond int64 is a 400 here, not an OverflowError (500) later.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_DEPTH = 64
# The ignored-fields warning names at most this many fields, each cut to this
# length: the names come from the client and must not flood the log.
_MAX_LOGGED_FIELDS = 16
_MAX_LOGGED_NAME = 64


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _param(path: list[str | int]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _check_raw(body: Any) -> None:
    """Reject what JSON allows but nothing downstream can hold.

    Lone UTF-16 surrogates ("\\ud800") are valid JSON but not encodable text
    (the tokenizer raises TypeError on them); integers beyond int64 overflow
    the engine's msgspec wire format; deep nesting overflows the recursion
    of whatever walks it next (pydantic, jinja). Iterative, so the check
    itself cannot overflow.
    """
    if not isinstance(body, dict):
        return  # not an object: field validation says so, naming no param
    stack: list[tuple[Any, list[str | int]]] = [(body, [])]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise PydanticCustomError(
                "too_deep",
                "{param} is nested more than {depth} levels deep",
                {"param": _param(path[:1]), "depth": MAX_DEPTH},
            )
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise PydanticCustomError(
                    "invalid_unicode",
                    "{param} contains invalid Unicode (a lone surrogate)",
                    {"param": _param(path)},
                ) from None
        elif isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:
                raise PydanticCustomError(
                    "int_out_of_range",
                    "{param} must be a 64-bit integer, got {value}",
                    {"param": _param(path), "value": value},
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path))  # a key names no param of its own
                stack.append((v, [*path, str(k)]))
        elif isinstance(value, list):
            stack.extend((v, [*path, i]) for i, v in enumerate(value))


def _range(lo: float, hi: float) -> dict[str, Any]:
    # Bounds for /openapi.json only: the checks stay in sampling.py and
    # `SamplingParams` (so errors keep their OpenAI wording); the schema
    # states them so clients and fuzzers see what is accepted.
    return {"minimum": lo, "maximum": hi}


def _ignored_fields_note(unknown: list[str]) -> str:
    shown = [repr(k[:_MAX_LOGGED_NAME]) for k in sorted(unknown)[:_MAX_LOGGED_FIELDS]]
    more = len(unknown) - len(shown)
    return "{" + ", ".join(shown) + (f", ... {more} more" if more > 0 else "") + "}"


class StrictRequest(BaseModel):
    """A request object: known fields strictly typed, unknown ones ignored and logged.

    vLLM's `OpenAIBaseModel` behaviour (it uses `extra="allow"` and logs "The
    following fields were present in the request but ignored"); here the
    extras are dropped (`extra="ignore"`) since nothing downstream reads them.
    """

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        result = handler(data)  # validation errors come first: a bad body is a 400
        if isinstance(data, dict):
            unknown = [str(k) for k in data if k not in cls.model_fields]
            if unknown:
                logger.warning(
                    "The following fields were present in the request but ignored: %s",
                    _ignored_fields_note(unknown),
                )
        return result


class TopLevelRequest(StrictRequest):
    """A request body: its raw JSON is screened once, before field validation."""

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        _check_raw(data)
        return data


class StreamOptions(StrictRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(StrictRequest):
    """OpenAI's response_format; `structures`/`triggers` (or `format`) for vLLM's structural_tag."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class SamplingFields(TopLevelRequest):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    # None (left out): the server default (--generation-config), then 0.
    frequency_penalty: float | None = Field(None, json_schema_extra=_range(-2, 2))
    presence_penalty: float | None = Field(None, json_schema_extra=_range(-2, 2))
    logit_bias: dict[str, float] | None = Field(
        None,
        json_schema_extra={
            "propertyNames": {"pattern": "^[0-9]{1,9}$"},
            "additionalProperties": {"type": "number", **_range(-100, 100)},
        },
    )
    n: int = Field(1, json_schema_extra=_range(1, 128))
    seed: int | None = Field(None, json_schema_extra=_range(0, INT64_MAX))
    stop: str | list[str] | None = Field(None, json_schema_extra={"minLength": 1})
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, json_schema_extra=_range(0, 2))
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = Field(None, json_schema_extra=_range(-1, INT64_MAX))
    min_p: float | None = Field(None, json_schema_extra=_range(0, 1))
    repetition_penalty: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0})
    min_tokens: int = Field(0, json_schema_extra=_range(0, INT64_MAX))
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(
        None, json_schema_extra={"items": {"type": "integer", "minimum": 0}}
    )
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None  # None: the server default, then true
    spaces_between_special_tokens: bool = True
    priority: int = Field(0, json_schema_extra=_range(INT64_MIN, INT64_MAX))
    request_id: str | None = None
    cache_salt: str | None = None
    # vLLM's KV connector instructions (checked in paged.server.kv_transfer).
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM 0.33's EPD field: {mm_hash: {"peer_host", "peer_port", ...}}, where each
    # item's encoder output is held (checked in paged.server.ec_transfer).
    ec_transfer_params: dict[str, Any] | None = None
    # Output constraints, at most one source (mapped and checked in openai/structured.py):
    # OpenAI's response_format, vLLM's structured_outputs, and vLLM's older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatMessageParam(BaseModel):
    """A message as sent; role and content are checked by the chat renderer."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(
        json_schema_extra={"enum": ["system", "developer", "user", "assistant", "tool"]}
    )
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageParam] = Field(json_schema_extra={"minItems": 1})
    logprobs: bool = False
    top_logprobs: int | None = Field(None, json_schema_extra=_range(0, 20))
    max_tokens: int | None = Field(
        default=None,
        description="Deprecated: max_completion_tokens",
        json_schema_extra=_range(1, INT64_MAX),
    )
    max_completion_tokens: int | None = Field(None, json_schema_extra=_range(1, INT64_MAX))
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields that change nothing about the tokens generated here:
    # accepted (the official API accepts them) and ignored.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None
    # Checked in sampling.py: only what this server can honour is accepted.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    # vLLM chat extras.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: with --reasoning-parser, false drops the thinking from the answer (and
    # structured output then constrains from the first token).
    include_reasoning: bool = True


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, json_schema_extra=_range(1, INT64_MAX))
    logprobs: int | None = Field(None, json_schema_extra=_range(0, 20))
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class TokenizeRequest(TopLevelRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    # Chat form only: tools for the chat template (vLLM's TokenizeChatRequest.tools).
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(TopLevelRequest):
    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


# -- responses -----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # What the EC connector answered (an EPD producer: where each item is held).
    ec_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None}


class DeltaToolCall(BaseModel):
    """A `delta.tool_calls[]` entry: id, type and name only in a call's first delta."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None}


class ChatMessage(BaseModel):
    role: str = Field(
        json_schema_extra={"enum": ["system", "developer", "user", "assistant", "tool"]}
    )
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    # vLLM 0.33's field (it no longer sends `reasoning_content`): the thinking, with
    # --reasoning-parser.
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_tool_calls(self, handler: Any) -> dict[str, Any]:
        # OpenAI sends `tool_calls` only when the model called tools; `reasoning`
        # only when there is some.
        data: dict[str, Any] = handler(self)
        for key in ("tool_calls", "reasoning"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # What the EC connector answered (an EPD producer: where each item is held).
    ec_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # a piece of the thinking (--reasoning-parser)
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        # A delta carries only what changed: `{"content": "x"}`, never nulls.
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "paged"
    root: str | None = None
    # The base model of a LoRA adapter's card (None for the base model), as vLLM.
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
