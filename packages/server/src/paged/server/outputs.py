"""What the frontend hands to users: `RequestOutput` and `CompletionOutput`.

Names and fields follow vLLM (`vllm/outputs.py`). Logprobs are one dict per
position, token id -> `Logprob`, the chosen token first, then the top
alternatives in rank order (a chosen token that is also in the top-k appears
once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# One position: token id -> its Logprob (insertion order: chosen first).
PositionLogprobs = dict[int, "Logprob"]
SampleLogprobs = list[PositionLogprobs]
# Position 0 of a prompt has no logprob (nothing precedes it).
PromptLogprobs = list[PositionLogprobs | None]


@dataclass(slots=True)
class Logprob:
    """One token's log probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample (of `n`) of a request.

    `text` and `token_ids` are cumulative or the delta since the last output,
    depending on the request's `output_kind`. `finish_reason` is "stop",
    "length", "abort" or "error" once finished; `stop_reason` is the stop
    string or stop token id that ended it (None for EOS or length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.time()) of one request as seen by the frontend."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    """The state of one user request: its prompt and its `n` samples so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Set when the request failed in the engine (finish reason "error").
    error: str | None = None
    # Why the engine finished it, when it said (e.g. a prompt that can never
    # fit the KV cache, finished with no tokens).
    finish_detail: str | None = None
    # What the KV connector returned when the request finished (vLLM's field).
    kv_transfer_params: dict[str, Any] | None = None
    # What the EC connector returned when the request finished (vLLM 0.33's
    # ec_transfer_params: an EPD producer's map of where each item is held).
    ec_transfer_params: dict[str, Any] | None = None


# Pooling outputs (vLLM keeps them in vllm/outputs.py too); their own module.
from paged.server.pooling_outputs import (  # noqa: E402
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "PoolingOutput",
    "PoolingRequestOutput",
    "PositionLogprobs",
    "PromptLogprobs",
    "RequestMetrics",
    "RequestOutput",
    "SampleLogprobs",
    "ScoringOutput",
    "ScoringRequestOutput",
]
