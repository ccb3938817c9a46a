"""The dispatch table of `run-batch`: which URL runs which handler on which request model.

vLLM 0.33 builds the same table (entrypoints/launchers/run_batch.py:773-866,
`build_endpoint_registry`): /v1/chat/completions, /v1/embeddings, and /score
and /rerank matched by suffix (url_matches, :662-667), which the table spells
out here as /score, /v1/score, /rerank, /v1/rerank, /v2/rerank. paged adds
/v1/completions. A route the model cannot serve answers each line with the
HTTP API's 400 naming the model's task.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from paged.server.openai.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from paged.server.openai.pooling_tasks import ModelTasks
from paged.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from paged.server.openai.serving import OpenAIServing
from paged.server.openai.serving_pooling import PoolingServing

Handler = Callable[[Any], Awaitable[BaseModel | AsyncIterator[str]]]


@dataclass(frozen=True, slots=True)
class BatchEndpoint:
    """`url` (exact, e.g. "/v1/chat/completions"): bodies validate as `request_type`,
    then `handler(body)` answers with a response model (a stream is refused)."""

    url: str
    request_type: type[BaseModel]
    handler: Handler


def openai_endpoints(
    serving: OpenAIServing, tasks: ModelTasks | None = None
) -> dict[str, BatchEndpoint]:
    """The generation endpoints of `serving`, by URL; `tasks` refuses them on a pooling model."""
    model_tasks = tasks if tasks is not None else ModelTasks()

    def chat(body: Any) -> Awaitable[BaseModel | AsyncIterator[str]]:
        model_tasks.require_generate("Chat Completions API")
        return serving.create_chat_completion(body)

    def completion(body: Any) -> Awaitable[BaseModel | AsyncIterator[str]]:
        model_tasks.require_generate("Completions API")
        return serving.create_completion(body)

    endpoints = [
        BatchEndpoint("/v1/chat/completions", ChatCompletionRequest, chat),
        BatchEndpoint("/v1/completions", CompletionRequest, completion),
    ]
    return {e.url: e for e in endpoints}


def pooling_endpoints(pooling: PoolingServing) -> dict[str, BatchEndpoint]:
    """The pooling endpoints vLLM 0.33's run-batch serves, by URL (each checks the task)."""
    endpoints = [BatchEndpoint("/v1/embeddings", EmbeddingRequest, pooling.create_embedding)]
    for url in ("/score", "/v1/score"):
        endpoints.append(BatchEndpoint(url, ScoreRequest, pooling.create_score))
    for url in ("/rerank", "/v1/rerank", "/v2/rerank"):
        endpoints.append(BatchEndpoint(url, RerankRequest, pooling.create_rerank))
    return {e.url: e for e in endpoints}
