"""The dispatch table of `run-batch`: which URL runs which handler on which request model.

vLLM 0.33 builds the same table (entrypoints/launchers/run_batch.py:773-866,
`build_endpoint_registry`); a new endpoint (e.g. /v1/embeddings) is one more
`BatchEndpoint` in the table passed to `run_batch_lines`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from paged.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from paged.server.openai.serving import OpenAIServing

Handler = Callable[[Any], Awaitable[BaseModel | AsyncIterator[str]]]


@dataclass(frozen=True, slots=True)
class BatchEndpoint:
    """`url` (exact, e.g. "/v1/chat/completions"): bodies validate as `request_type`,
    then `handler(body)` answers with a response model (a stream is refused)."""

    url: str
    request_type: type[BaseModel]
    handler: Handler


def openai_endpoints(serving: OpenAIServing) -> dict[str, BatchEndpoint]:
    """The generation endpoints of `serving`, by URL."""
    chat = serving.create_chat_completion
    endpoints = [
        BatchEndpoint("/v1/chat/completions", ChatCompletionRequest, chat),
        BatchEndpoint("/v1/completions", CompletionRequest, serving.create_completion),
    ]
    return {e.url: e for e in endpoints}
