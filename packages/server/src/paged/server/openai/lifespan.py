"""The app's lifespan: the engine stops when the server does, signals included.

`serve()` cannot do it after `uvicorn.run()` returns: on SIGTERM or SIGINT,
uvicorn shuts the app down and then re-raises the signal, so the process dies
before any code after `run()` (or its `finally`) executes, and the engine
process would be left behind, still generating. The lifespan's exit runs
inside uvicorn's shutdown, after in-flight requests were given their grace
period and before the signal is re-raised.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

logger = logging.getLogger(__name__)


class _Shutdownable(Protocol):
    def shutdown(self) -> None: ...


def engine_lifespan(
    llm: _Shutdownable, startup: Callable[[], Awaitable[None]] | None = None
) -> Callable[[object], AbstractAsyncContextManager[None]]:
    """A FastAPI `lifespan` that shuts `llm` (and so its engine process) down on exit.

    `startup` runs on the server's event loop before it accepts requests (the
    static LoRA adapters load there); if it raises, the server does not start.
    """

    @contextlib.asynccontextmanager
    async def lifespan(_: object) -> AsyncIterator[None]:
        try:
            if startup is not None:
                await startup()
            yield
        finally:
            logger.info("server shutting down: stopping the engine")
            llm.shutdown()

    return lifespan
