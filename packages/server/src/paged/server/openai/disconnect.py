"""Cancel a request's work when its HTTP client goes away (API server and proxy)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(
    request: Request, work: Coroutine[Any, Any, T], cancelled: str = "request aborted"
) -> T | None:
    """Run `work`; if the client disconnects first, cancel it and return None.

    Cancelling is what frees the work's resources: the engine aborts the
    request's sequences, the proxy closes its upstream connections.
    `cancelled` is logged to say which.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    logger.info("client disconnected; %s", cancelled)
    return None
