"""Request and response models of the pooling endpoints, in vLLM 0.33's shapes.

/v1/embeddings (OpenAI), /pooling, /classify, /score and /rerank (Jina /
Cohere style). Field names, defaults and response layouts follow
vllm/entrypoints/pooling/{base,embed,pooling,classify,scoring}/protocol.py.
Known fields are typed strictly like the generation requests (a token list
holding a string, or a list mixing strings and token ids, is a 400 at
validation); unknown fields are ignored with a warning, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from paged.server.errors import InvalidRequestError
from paged.server.openai.protocol import (
    INT64_MAX,
    INT64_MIN,
    ChatMessageParam,
    StrictRequest,
    TopLevelRequest,
    UsageInfo,
)

EncodingFormat = Literal["float", "base64"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
# A completion-style input: one text, several texts, one token list, several token lists.
CompletionInput = str | list[str] | list[int] | list[list[int]]


def _is_chat_message(value: object) -> bool:
    return isinstance(value, dict) and isinstance(value.get("role"), str)


def field_error(param: str, message: str) -> PydanticCustomError:
    """A validation error the API answers as a 400 naming `param` with `message` as is."""
    return PydanticCustomError("invalid_field", "{message}", {"param": param, "message": message})


def _reject_removed_fields(data: Any) -> Any:
    """vLLM 0.33's messages for fields it removed (base/protocol.py:23-32, tasks.py:20-31)."""
    if not isinstance(data, dict):
        return data
    if "normalize" in data:
        raise field_error(
            "normalize", "Parameter `normalize` was removed; use `use_activation` instead."
        )
    task = data.get("task")
    if task == "score":
        raise field_error("task", "`score` task was removed; use `classify` instead.")
    if task == "encode":
        raise field_error(
            "task", "`encode` task was removed; use `token_embed` or `token_classify` instead."
        )
    return data


class PoolingBasicFields(TopLevelRequest):
    """Fields every pooling request shares (vLLM's PoolingBasicRequestMixin)."""

    model: str | None = None
    user: str | None = None  # accepted, as OpenAI's; nothing reads it
    # -1: truncate to max_model_len; N: keep N tokens (the side: truncation_side,
    # else the tokenizer's own, "right" for Hugging Face tokenizers).
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        return _reject_removed_fields(data)


class TextInputFields(PoolingBasicFields):
    """`input` (completion style) or `messages` (chat style, one conversation or a batch).

    vLLM 0.33 also takes a conversation in `input` (EmbeddingChatInputRequest,
    embed/protocol.py:109-156): it is moved to `messages` before validation.
    """

    input: CompletionInput | None = None
    messages: list[ChatMessageParam] | list[list[ChatMessageParam]] | None = None
    add_special_tokens: bool | None = None  # None: True for input, False for messages
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _chat_in_input(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "messages" in data or "input" not in data:
            return data
        value = data["input"]
        if isinstance(value, list) and value:
            one = all(_is_chat_message(m) for m in value)
            batch = all(
                isinstance(c, list) and c and all(_is_chat_message(m) for m in c) for c in value
            )
            if one or batch:
                return {**{k: v for k, v in data.items() if k != "input"}, "messages": value}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> TextInputFields:
        if (self.input is None) == (self.messages is None):
            raise field_error("input", "give exactly one of input or messages")
        if self.add_generation_prompt and self.continue_final_message:
            raise field_error(
                "continue_final_message",
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            )
        return self


class EncodingFields(StrictRequest):
    encoding_format: EncodingFormat = "float"
    # base64 only: the dtype and byte order of the encoded vector (vLLM's extras;
    # the defaults match the openai client, which decodes native float32).
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"


class EmbeddingRequest(TextInputFields, EncodingFields):
    """POST /v1/embeddings (vLLM's EmbeddingCompletionRequest / EmbeddingChatRequest)."""

    dimensions: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    use_activation: bool | None = None


class PoolingRequest(TextInputFields, EncodingFields):
    """POST /pooling: the raw pooler output for `task` (default: the model's task)."""

    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    dimensions: int | None = None  # refused: vLLM's /pooling does not support it
    use_activation: bool | None = None


class ClassificationRequest(TextInputFields):
    """POST /classify."""

    use_activation: bool | None = None


ScoreItems = str | list[str]


class ScoringFields(PoolingBasicFields):
    """What /score and /rerank share (vLLM's ScoringRequestMixin, text inputs only)."""

    use_activation: bool | None = None
    max_tokens_per_query: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    max_tokens_per_doc: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    # Read by the server's score template (--chat-template), e.g. Qwen3-Reranker's
    # `instruction`; `instruction` is folded into chat_template_kwargs, which wins
    # (vllm/entrypoints/pooling/scoring/protocol.py:38-67).
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _merge_instruction(self) -> ScoringFields:
        if self.instruction is not None:
            merged = dict(self.chat_template_kwargs or {})
            merged.setdefault("instruction", self.instruction)
            self.chat_template_kwargs = merged
        return self


class ScoreRequest(ScoringFields):
    """POST /score: one of vLLM 0.33's name pairs (queries/documents, queries/items,
    data_1/data_2, text_1/text_2), each a string or a list of strings (1:1, 1:N, N:N)."""

    queries: ScoreItems | None = None
    documents: ScoreItems | None = None
    items: ScoreItems | None = None
    data_1: ScoreItems | None = None
    data_2: ScoreItems | None = None
    text_1: ScoreItems | None = None
    text_2: ScoreItems | None = None

    def pair(self) -> tuple[list[str], list[str]]:
        """The two sides, each as a list; a 400 unless exactly one name pair is given."""
        if self.documents is not None and self.items is not None:
            raise InvalidRequestError("items", "give documents or items, not both")
        pairs = [
            (self.queries, self.documents),
            (self.queries, self.items),
            (self.data_1, self.data_2),
            (self.text_1, self.text_2),
        ]
        for left, right in pairs:
            if left is not None and right is not None:
                return _as_list(left), _as_list(right)
        raise InvalidRequestError(
            "queries",
            "give the texts to score as queries and documents "
            "(or queries/items, data_1/data_2, text_1/text_2)",
        )


class RerankRequest(ScoringFields):
    """POST /rerank, /v1/rerank, /v2/rerank (Jina / Cohere)."""

    query: str
    documents: ScoreItems
    top_n: int = Field(0, ge=0, le=INT64_MAX)
    # Cohere's field: False leaves the documents out of the results (vLLM 0.33 has
    # no such field and always returns them, as the default here does).
    return_documents: bool = True


def _as_list(value: ScoreItems) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


# -- responses ---------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class EmbeddingResponseData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingResponseData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[list[float]] | list[float] | str


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreResponseData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: str | None = None
    multi_modal: list[dict[str, Any]] | None = None  # vLLM's field; always null here (text only)


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
