"""The OpenAI Batch line formats, as vLLM 0.33 (entrypoints/launchers/run_batch.py:163-240).

In:  {"custom_id": str, "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Out: {"id": "vllm-<hex>", "custom_id": str, "response": {"status_code": int,
      "request_id": "vllm-batch-<hex>", "body": {...} | null}, "error": null | ...}

A failed line keeps `response` (status code, request id, null body) and puts
the reason in `error`: the API's error object (`{"error": {...}}`) when a
handler refused the body, a message string otherwise (vLLM's
make_error_request_output, :588-600).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict


class BatchRequestInput(BaseModel):
    """One input line (the body is validated by its endpoint's request model)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class BatchResponseData(BaseModel):
    status_code: int = 200
    request_id: str
    body: dict[str, Any] | None = None


class BatchRequestOutput(BaseModel):
    id: str
    custom_id: str | None
    response: BatchResponseData | None
    error: Any | None


def _hex() -> str:
    return uuid.uuid4().hex


def success_output(custom_id: str, body: dict[str, Any]) -> BatchRequestOutput:
    return BatchRequestOutput(
        id=f"vllm-{_hex()}",
        custom_id=custom_id,
        response=BatchResponseData(request_id=f"vllm-batch-{_hex()}", body=body),
        error=None,
    )


def error_output(custom_id: str | None, error: Any, status_code: int = 400) -> BatchRequestOutput:
    """A failed line: `error` is a message or the API's error object."""
    return BatchRequestOutput(
        id=f"vllm-{_hex()}",
        custom_id=custom_id,
        response=BatchResponseData(status_code=status_code, request_id=f"vllm-batch-{_hex()}"),
        error=error,
    )
