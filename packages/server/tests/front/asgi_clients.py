"""Clients the front-end tests talk to an app through: in-process, no sockets."""

from __future__ import annotations

from typing import Any

import httpx
import openai


def asgi_client(app: Any) -> httpx.AsyncClient:
    """An httpx client that calls the ASGI `app` directly."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def openai_client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """The openai client over `http` (an `asgi_client`), without retries."""
    return openai.AsyncOpenAI(
        api_key="unused",
        base_url="http://test/v1",
        http_client=http,  # type: ignore[arg-type]
        max_retries=0,
    )
