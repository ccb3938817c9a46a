"""Cache-control routes: `POST /reset_prefix_cache` (vLLM's route).

200 with an empty body once the device prefix cache is dropped (as vLLM).
A reset is refused while running requests hold cached blocks: then 409 with
an OpenAI-style error body, so a client never proceeds believing the cache
is empty when it is not (vLLM logs and still answers 200).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from paged.server.openai.protocol import ErrorInfo, ErrorResponse

if TYPE_CHECKING:
    from paged.server.async_llm import AsyncLLM


def add_cache_routes(app: FastAPI, llm: AsyncLLM) -> None:
    @app.post(
        "/reset_prefix_cache",
        response_class=Response,
        responses={
            200: {"description": "The prefix cache was reset (empty body)"},
            409: {"model": ErrorResponse},
        },
    )
    async def reset_prefix_cache() -> Response:
        if not await llm.reset_prefix_cache():
            message = "The prefix cache cannot be reset while requests hold cached blocks"
            body = ErrorResponse(error=ErrorInfo(message=message, type="invalid_request_error"))
            return JSONResponse(body.model_dump(), status_code=409)
        return Response(status_code=200)
