"""`add_request` checks: reject bad input with a ValueError naming the field, or
finish a prompt that can never be served as IGNORED with a reason.

Rejection leaves no trace (nothing registered, no blocks). An ignored request
is reported once, through the next `update_from_output`, so a frontend
waiting on it always gets a finished `EngineCoreOutput`.
"""

from __future__ import annotations

from collections.abc import Container

from paged.scheduler.boundary import EngineCoreOutput, EngineCoreRequest, FinishReason
from paged.scheduler.config import SchedulerConfig


def validate_request(
    request: EngineCoreRequest, config: SchedulerConfig, known_ids: Container[str]
) -> None:
    """Raise ValueError naming the first field of `request` that cannot be served."""
    if not isinstance(request.request_id, str) or not request.request_id:
        raise ValueError("request_id must be a non-empty string")
    if request.request_id in known_ids:
        raise ValueError(f"request_id {request.request_id!r} is already in use")
    if not request.prompt_token_ids:
        raise ValueError("prompt_token_ids must not be empty")
    if any(t < 0 for t in request.prompt_token_ids):
        raise ValueError("prompt_token_ids must be non-negative token ids")
    request.sampling_params.validate(max_logprobs=config.max_logprobs)
    if request.client_index < 0:
        raise ValueError(f"client_index must be >= 0, got {request.client_index}")
    _validate_mm_features(request)


def _validate_mm_features(request: EngineCoreRequest) -> None:
    if not request.mm_features:
        return
    prompt_len = len(request.prompt_token_ids)
    prev_end = 0
    for i, feature in enumerate(request.mm_features):
        pos = feature.mm_position
        if pos.offset < prev_end:
            raise ValueError(
                f"mm_features[{i}] overlaps or precedes the previous item "
                "(items must be sorted by offset and disjoint)"
            )
        if pos.end > prompt_len:
            raise ValueError(
                f"mm_features[{i}] placeholder [{pos.offset}, {pos.end}) lies outside the "
                f"prompt of {prompt_len} tokens"
            )
        prev_end = pos.end


def unservable_reason(
    request: EngineCoreRequest,
    config: SchedulerConfig,
    max_tokens_in_kv_cache: int,
    encoder_cache_size: int,
    encoder_compute_budget: int,
) -> tuple[FinishReason, str] | None:
    """Why a valid request can never run on this engine, or None if it can."""
    prompt_len = len(request.prompt_token_ids)
    if prompt_len > config.max_model_len:
        return (
            FinishReason.LENGTH,
            f"prompt has {prompt_len} tokens, more than max_model_len={config.max_model_len}",
        )
    if prompt_len > max_tokens_in_kv_cache:
        return (
            FinishReason.LENGTH,
            f"prompt has {prompt_len} tokens but the KV cache holds at most "
            f"{max_tokens_in_kv_cache} tokens for one request",
        )
    for i, feature in enumerate(request.mm_features or ()):
        embeds = feature.mm_position.get_num_embeds()
        limit = min(encoder_cache_size, encoder_compute_budget)
        if embeds > limit:
            return (
                FinishReason.ABORT,
                f"mm_features[{i}] needs {embeds} encoder embeddings, more than the encoder "
                f"cache size / compute budget allows ({limit})",
            )
    return None


def ignored_output(
    request: EngineCoreRequest, reason: FinishReason, detail: str
) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=reason,
        finish_detail=detail,
    )
