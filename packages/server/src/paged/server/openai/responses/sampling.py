"""Responses request fields -> `SamplingParams` (vLLM 0.33's to_sampling_params,
responses/protocol.py:580-665) and `text.format` -> structured output
(extract_structured_outputs, protocol.py:548-577)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from paged.scheduler import RequestOutputKind, SamplingParams, StructuredOutputsParams
from paged.server.errors import InvalidRequestError
from paged.server.openai.responses.protocol import ResponsesRequest
from paged.server.openai.structured import structured_outputs_field

# vLLM's ResponsesRequest._DEFAULT_SAMPLING_PARAMS, under the server's defaults.
_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "skip_special_tokens": True,
}
_F32_TINY = 1.1754943508222875e-38  # see openai/sampling.py: top_p below it is 0 in float32


def text_format_constraint(req: ResponsesRequest) -> StructuredOutputsParams | None:
    """`text.format` (json_schema, json_object, text) or vLLM's `structured_outputs`."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        if req.structured_outputs is None:
            return None
        return structured_outputs_field(req.structured_outputs)
    if req.structured_outputs is not None:
        raise InvalidRequestError(
            "structured_outputs", "Cannot specify both structured_outputs and text.format"
        )
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format", "text.format must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise InvalidRequestError(
            "text.format.type",
            f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        )
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError("text.format.schema", "text.format.schema must be an object")
    return StructuredOutputsParams(json=json.dumps(schema))


def _check_ranges(req: ResponsesRequest) -> None:
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise InvalidRequestError(
            "temperature", f"temperature must be between 0 and 2, got {req.temperature}"
        )
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise InvalidRequestError("top_p", f"top_p must be in (0, 1], got {req.top_p}")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise InvalidRequestError(
            "max_output_tokens",
            f"max_output_tokens must be at least 1, got {req.max_output_tokens}",
        )
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise InvalidRequestError(
            "top_logprobs", f"top_logprobs must be between 0 and 20, got {req.top_logprobs}"
        )


def responses_sampling_params(
    req: ResponsesRequest, tool_schema_json: str | None, defaults: Mapping[str, Any]
) -> SamplingParams:
    """`tool_schema_json`: the schema a forced tool choice constrains the output to."""
    _check_ranges(req)

    def pick(name: str, value: Any) -> Any:
        # vLLM's priority: the request's value, the server's default, the API default.
        return value if value is not None else defaults.get(name, _DEFAULTS[name])

    constraint = text_format_constraint(req)
    if tool_schema_json is not None:
        if constraint is not None:
            raise InvalidRequestError(
                "tool_choice",
                "tool_choice 'required' or a named function constrains the output to the "
                "tool call; it cannot be combined with text.format",
            )
        constraint = StructuredOutputsParams(json=tool_schema_json, disable_any_whitespace=True)
    top_p = float(pick("top_p", req.top_p))
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    logprobs = "message.output_text.logprobs" in (req.include or [])
    return SamplingParams(
        temperature=pick("temperature", req.temperature),
        top_p=_F32_TINY if 0.0 < top_p < _F32_TINY else top_p,
        top_k=pick("top_k", req.top_k),
        min_p=pick("min_p", req.min_p),
        seed=req.seed,
        presence_penalty=pick("presence_penalty", req.presence_penalty),
        frequency_penalty=pick("frequency_penalty", req.frequency_penalty),
        repetition_penalty=pick("repetition_penalty", req.repetition_penalty),
        logit_bias=_logit_bias(req.logit_bias),
        max_tokens=req.max_output_tokens,  # None: what fits (InputProcessor)
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=(req.top_logprobs or 0) if logprobs else None,
        skip_special_tokens=pick("skip_special_tokens", req.skip_special_tokens),
        include_stop_str_in_output=req.include_stop_str_in_output,
        output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
        structured_outputs=constraint,
    )


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not key.isdigit():
            raise InvalidRequestError("logit_bias", f"logit_bias keys must be token ids: {key!r}")
        out[int(key)] = value
    return out
