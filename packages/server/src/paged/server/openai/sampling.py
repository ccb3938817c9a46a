"""OpenAI request fields -> `SamplingParams`, with the API's own range checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from paged.scheduler import RequestOutputKind, SamplingParams, StructuredOutputsParams
from paged.server.errors import InvalidRequestError
from paged.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from paged.server.openai.structured import structured_outputs_of

MAX_N = 128
# The smallest normal float32. The runner samples in float32, where a top_p
# like 5e-324 (valid: it is > 0) becomes 0.0, which the sampler refuses,
# killing the engine core. Any top_p at or below the best token's probability
# (>= 1/vocab) keeps just that token, so raising tiny values to this one
# changes no result.
_F32_TINY = 1.1754943508222875e-38


def _check_common(req: SamplingFields) -> None:
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise InvalidRequestError(
            "temperature", f"temperature must be between 0 and 2, got {req.temperature}"
        )
    if not 1 <= req.n <= MAX_N:
        raise InvalidRequestError("n", f"n must be between 1 and {MAX_N}, got {req.n}")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError(
            "stream_options", "stream_options is only allowed when stream is true"
        )


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(
                "logit_bias", f"logit_bias keys must be token ids, got {key!r}"
            ) from None
        if not -100.0 <= value <= 100.0:
            raise InvalidRequestError(
                "logit_bias", f"logit_bias values must be between -100 and 100, got {value}"
            )
        out[token] = value
    return out


def _float32_top_p(top_p: float) -> float:
    # Out-of-range values (<= 0, > 1, NaN) are left for SamplingParams to reject.
    return _F32_TINY if 0.0 < top_p < _F32_TINY else top_p


def _base(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: Mapping[str, Any],
) -> SamplingParams:
    _check_common(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])

    def pick(name: str, value: Any, openai_default: Any) -> Any:
        # vLLM's priority: the request's value, the server's default, OpenAI's default.
        return value if value is not None else defaults.get(name, openai_default)

    top_p = pick("top_p", req.top_p, 1.0)
    skip_special = pick("skip_special_tokens", req.skip_special_tokens, True)
    return SamplingParams(
        n=req.n,
        temperature=pick("temperature", req.temperature, 1.0),
        top_p=_float32_top_p(top_p),
        top_k=pick("top_k", req.top_k, 0),
        min_p=pick("min_p", req.min_p, 0.0),
        seed=req.seed,
        presence_penalty=pick("presence_penalty", req.presence_penalty, 0.0),
        frequency_penalty=pick("frequency_penalty", req.frequency_penalty, 0.0),
        repetition_penalty=pick("repetition_penalty", req.repetition_penalty, 1.0),
        logit_bias=_logit_bias(req.logit_bias),
        max_tokens=max_tokens,  # None: the server default or what fits (InputProcessor)
        min_tokens=req.min_tokens,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=skip_special,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=structured_outputs_of(req),
    )


def chat_sampling_params(
    req: ChatCompletionRequest,
    tool_schema_json: str | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """`tool_schema_json`: the schema a tool choice constrains the output to (tools.py);
    `defaults`: the server's values for fields the request leaves out (generation_defaults)."""
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise InvalidRequestError("modalities", "only the 'text' modality is supported")
    if req.audio is not None:
        raise InvalidRequestError("audio", "audio output is not supported")
    if req.metadata is not None and len(req.metadata) > 16:
        raise InvalidRequestError("metadata", "metadata holds at most 16 key-value pairs")
    logprobs: int | None = None
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise InvalidRequestError("top_logprobs", "top_logprobs requires logprobs to be true")
        if not 0 <= req.top_logprobs <= 20:
            raise InvalidRequestError(
                "top_logprobs", f"top_logprobs must be between 0 and 20, got {req.top_logprobs}"
            )
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else None
    if max_tokens is None:
        max_tokens = req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError(param, f"{param} must be at least 1, got {max_tokens}")
    params = _base(req, max_tokens, logprobs, defaults or {})
    if tool_schema_json is None:
        return params
    if params.structured_outputs is not None:
        # One constraint per request: the tool call's schema or the user's, not both.
        raise InvalidRequestError(
            "tool_choice",
            "tool_choice 'required', a named function, or any tool choice in the generic "
            "tool format (a chat template that ignores tools) constrains the output to the "
            "tool call; it cannot be combined with response_format or structured_outputs",
        )
    return msgspec.structs.replace(
        params,
        # A tool call is read by a machine: no free whitespace (a weak model could fill
        # max_tokens with it and never close the call).
        structured_outputs=StructuredOutputsParams(
            json=tool_schema_json, disable_any_whitespace=True
        ),
    )


def completion_sampling_params(
    req: CompletionRequest, defaults: Mapping[str, Any] | None = None
) -> SamplingParams:
    if req.suffix is not None:
        raise InvalidRequestError("suffix", "suffix is not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequestError("best_of", "best_of other than n is not supported")
    if req.echo and req.logprobs is not None:
        raise InvalidRequestError("echo", "echo together with logprobs is not supported")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise InvalidRequestError(
            "max_tokens", f"max_tokens must be at least 1, got {req.max_tokens}"
        )
    return _base(req, req.max_tokens, req.logprobs, defaults or {})
