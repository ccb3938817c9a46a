"""Per-iteration frontend statistics, consumed by the Prometheus logger."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged.scheduler import FinishReason


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    finish_reason: FinishReason
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass(slots=True)
class IterationStats:
    """What one batch of engine outputs did, seen from the frontend."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # Pooling requests (embed/classify/...) finished in this batch: counted apart
    # from generation (they have no generated tokens); for the API's metrics.
    num_pooling_requests: int = 0
