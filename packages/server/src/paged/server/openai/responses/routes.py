"""The /v1/responses routes (vLLM 0.33's api_router.py: POST, GET {id}, POST {id}/cancel;
0.33 has no DELETE)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from paged.server.openai.responses.protocol import ResponsesRequest, ResponsesResponse
from paged.server.openai.responses.serving import OpenAIServingResponses

Respond = Callable[[Request, Awaitable[Any]], Awaitable[Response]]


def add_responses_routes(
    app: FastAPI,
    handler: OpenAIServingResponses,
    respond: Respond,
    errors: dict[int | str, dict[str, Any]],
) -> None:
    """`respond`: the app's runner (client-disconnect aware; SSE for an async iterator)."""

    @app.post(
        "/v1/responses",
        response_model=ResponsesResponse,
        responses={**errors, 200: {"content": {"text/event-stream": {}}}},
    )
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await respond(request, handler.create(body))

    @app.get(
        "/v1/responses/{response_id}",
        response_model=ResponsesResponse,
        responses={**errors, 200: {"content": {"text/event-stream": {}}}},
    )
    async def retrieve_response(
        response_id: str, request: Request, stream: bool = False, starting_after: int | None = None
    ) -> Response:
        return await respond(request, handler.retrieve(response_id, stream, starting_after))

    @app.post(
        "/v1/responses/{response_id}/cancel", response_model=ResponsesResponse, responses=errors
    )
    async def cancel_response(response_id: str) -> JSONResponse:
        response = await handler.cancel(response_id)
        return JSONResponse(response.model_dump(mode="json"))
