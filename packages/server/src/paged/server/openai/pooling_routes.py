"""The pooling routes, registered next to the generation ones by `build_app`.

vLLM 0.33's paths (vllm/entrypoints/pooling/*/api_router.py): /v1/embeddings,
/pooling, /classify, /score and /v1/score, /rerank, /v1/rerank and
/v2/rerank. /v1/score and /v1/rerank log vLLM's note that the API lives at
/score and /rerank, once per server.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from paged.server.openai.pooling_protocol import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from paged.server.openai.serving_pooling import PoolingServing

logger = logging.getLogger(__name__)

Respond = Callable[[Request, Awaitable[BaseModel]], Awaitable[Response]]


def add_pooling_routes(
    app: FastAPI, serving: PoolingServing, respond: Respond, errors: dict[int | str, dict[str, Any]]
) -> None:
    """Register the pooling endpoints; `respond` runs a handler until the client leaves."""
    warned: set[str] = set()

    def moved(path: str, to: str) -> None:
        if path not in warned:
            warned.add(path)
            logger.warning(
                "%s is not part of the standard OpenAI API: it also lives at %s. "
                "Please update your client accordingly.",
                path,
                to,
            )

    def header_id(request: Request) -> str | None:
        return request.headers.get("X-Request-Id")

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=errors)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await respond(request, serving.create_embedding(body, header_id(request)))

    @app.post("/pooling", response_model=PoolingResponse, responses=errors)
    async def pooling(body: PoolingRequest, request: Request) -> Response:
        return await respond(request, serving.create_pooling(body, header_id(request)))

    @app.post("/classify", response_model=ClassificationResponse, responses=errors)
    async def classify(body: ClassificationRequest, request: Request) -> Response:
        return await respond(request, serving.create_classify(body, header_id(request)))

    @app.post("/score", response_model=ScoreResponse, responses=errors)
    async def score(body: ScoreRequest, request: Request) -> Response:
        return await respond(request, serving.create_score(body, header_id(request)))

    @app.post("/v1/score", response_model=ScoreResponse, responses=errors)
    async def score_v1(body: ScoreRequest, request: Request) -> Response:
        moved("/v1/score", "/score")
        return await respond(request, serving.create_score(body, header_id(request)))

    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await respond(request, serving.create_rerank(body, header_id(request)))

    app.post("/rerank", response_model=RerankResponse, responses=errors)(rerank)
    app.post("/v2/rerank", response_model=RerankResponse, responses=errors)(rerank)

    @app.post("/v1/rerank", response_model=RerankResponse, responses=errors)
    async def rerank_v1(body: RerankRequest, request: Request) -> Response:
        moved("/v1/rerank", "/rerank")
        return await rerank(body, request)
