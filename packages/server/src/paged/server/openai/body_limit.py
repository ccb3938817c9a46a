"""A bound on request body size: 413 before an oversized body is read.

A body whose `Content-Length` is over the limit is refused from the header
alone, without reading a byte of it; a chunked body is counted as the app
reads it, and refused at the first chunk that crosses the limit. Either way
the server never holds more than the limit (plus one chunk) of one request.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paged.server.openai.protocol import ErrorInfo, ErrorResponse

# 16 MiB: over 3x a request filling a 1M-token context as JSON token ids
# (~7 bytes a token), far over any text prompt that fits a model served here.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20


def too_large_message(limit: int) -> str:
    return (
        f"The request body is larger than this server's limit of {limit} bytes "
        "(paged serve --max-request-body-size)."
    )


class BodySizeLimitMiddleware:
    """Plain ASGI (streaming responses pass through untouched); HTTP only."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _too_large(self.max_bytes)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the app's body read: FastAPI passes an
                    # HTTPException through, and the app's handler renders it.
                    raise HTTPException(413, too_large_message(self.max_bytes))
            return message

        await self.app(scope, counting_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed length itself
    return None


def _too_large(limit: int) -> JSONResponse:
    info = ErrorInfo(message=too_large_message(limit), type="invalid_request_error")
    # Connection: close, since the unread body is still on the wire.
    return JSONResponse(
        ErrorResponse(error=info).model_dump(), status_code=413, headers={"connection": "close"}
    )
